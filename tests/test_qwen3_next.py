"""qwen3_next and qwen3_5_moe (the hybrid decoder of mlxcel_dist/nn/deltanet.py):
what the per-family runners do not see.

The runners compare logits in every mode at np 1-4; here: the DeltaNet state a
chunked prefill and decode steps carry (DeltaNetCache) equals the one-pass
state, config forms (transformers 4 keys, the multimodal text_config),
the other weight layouts (the hub's fused experts, mlx-lm's own 4-bit
conversion at np 1 and np 2), the tensor-parallel split of the DeltaNet heads
(key-head groups, state per rank), the prompt cache (a shared prefix restores
the states exactly), compiled decode (the state in static buffers: the eager
steps' logits bit for bit), batch rows and serve (greedy batched == alone)."""

import json
import shutil
import sys
import threading
import urllib.request

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.cache import FULL, LINEAR, DeltaNetCache, KVCache
from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.engine.generation import Generation, sequence_logits
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, all_mode_logits, compare
from mlxcel_dist.checkpoint.loader import build_model, load_model
from mlxcel_dist.parallel.shard import collect_plan

from reference_cases import FIXTURES
from testproc import run_cmd

NEXT = FIXTURES / "qwen3_next" / "hybrid_fp32"
NEXT2 = FIXTURES / "qwen3_next" / "full_first_fp32"
HUB = FIXTURES / "qwen3_5_moe" / "hub_fp32"
TEXT = FIXTURES / "qwen3_5_moe" / "text_fp32"
MLX_LM = {"qwen3_next": FIXTURES / "mlx_lm" / "qwen3_next_q4", "qwen3_5_moe": FIXTURES / "mlx_lm" / "qwen3_5_moe_q4"}


def _states(cache):
    return [(np.array(c.conv_state), np.array(c.recurrent_state)) for c in cache if isinstance(c, DeltaNetCache)]


@pytest.mark.parametrize("L,Hk,Hv", [(150, 2, 4), (5, 3, 3), (64, 1, 2)])
def test_chunked_delta_rule_is_the_token_loop(L, Hk, Hv):
    # transformers' chunked form (UT transform per chunk of 64, the unit-lower
    # inverse by repeated squaring; padded last chunk) against the plain
    # recurrence token by token, from a nonzero state: outputs and final state.
    from mlxcel_dist.nn.deltanet import gated_delta_rule

    rng = np.random.default_rng(L)
    B, Dk, Dv = 2, 8, 16
    q, k = (mx.array(rng.standard_normal((B, L, Hk, Dk)), mx.float32) for _ in range(2))
    v = mx.array(rng.standard_normal((B, L, Hv, Dv)), mx.float32)
    g = mx.array(-0.3 * np.abs(rng.standard_normal((B, L, Hv))), mx.float32)
    beta = mx.array(1 / (1 + np.exp(-rng.standard_normal((B, L, Hv)))), mx.float32)
    S0 = mx.array(0.1 * rng.standard_normal((B, Hv, Dk, Dv)), mx.float32)
    o1, s1 = gated_delta_rule(q, k, v, g, beta, S0, chunked=False)
    o2, s2 = gated_delta_rule(q, k, v, g, beta, S0, chunked=True)
    assert float(mx.abs(o1 - o2).max()) <= 2e-6 * float(mx.abs(o1).max())
    assert float(mx.abs(s1 - s2).max()) <= 2e-6 * float(mx.abs(s1).max())


@pytest.mark.parametrize("d", [NEXT, HUB], ids=["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("step", [1, 2, 3, 7, 20])
def test_chunked_prefill_carries_the_one_pass_state(d, step):
    # Chunks shorter than the conv's 3 earlier inputs must take them from the
    # conv state; the delta rule's state must carry across every boundary.
    model = load_model(d).model
    ids = np.load(d / "reference.npz")["ids"][:30]
    one = model.make_cache()
    model(mx.array(ids)[None], one)
    chunked = model.make_cache()
    for s in range(0, len(ids), step):
        model(mx.array(ids[s : s + step])[None], chunked)
    assert all(c.offset == len(ids) for c in chunked)
    a = model.args
    for (conv1, s1), (conv2, s2) in zip(_states(one), _states(chunked)):
        assert conv1.shape == (1, 3, 2 * a.linear_num_key_heads * a.linear_key_head_dim
                               + a.linear_num_value_heads * a.linear_value_head_dim)
        assert s1.shape == (1, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim)
        assert s1.dtype == np.float32
        # equal to fp32 rounding: one pass runs the chunked delta rule, 1-token chunks the
        # plain step (4e-7 apart, test above), and a layer's inputs carry the earlier layers' rounding
        np.testing.assert_allclose(conv2, conv1, rtol=0, atol=1e-5 * np.abs(conv1).max())
        np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-5 * np.abs(s1).max())


def test_cache_kinds_masks_and_layers():
    model = load_model(NEXT2).model
    assert model.args.layer_types == [FULL, LINEAR, LINEAR, FULL, LINEAR]
    cache = model.make_cache()
    assert [type(c) for c in cache] == [KVCache, DeltaNetCache, DeltaNetCache, KVCache, DeltaNetCache]
    assert not cache[1].static_kv and cache[1].state == [] and cache[1].mask(5) is None
    masks = model.masks(5, cache)
    assert masks[LINEAR] is None and masks[FULL] == "causal"
    lines = model.describe_layers()
    assert lines[0].startswith("0: full, gated") and "partial 0.5" in lines[0] and "dense mlp" in lines[0]
    assert lines[1].startswith("1: gated deltanet (4 key / 4 value heads, conv 4)") and "moe 4 experts" in lines[1]


def _config(d, **changes):
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    return c


def test_transformers4_config_defaults():
    # Hub Qwen3-Next configs: top-level rope_theta, partial_rotary_factor
    # absent means 0.25 (Qwen3NextConfig's default), full_attention_interval
    # instead of layer_types.
    c = _config(NEXT)
    for k in ("rope_parameters", "layer_types"):
        c.pop(k)
    c.update(rope_theta=12345.0, full_attention_interval=2)
    args = build_model(c).args
    assert args.rope == {"rope_type": "default", "rope_theta": 12345.0, "partial_rotary_factor": 0.25}
    assert args.layer_types == [LINEAR, FULL, LINEAR, FULL]
    assert build_model(_config(NEXT, layer_types=None)).args.layer_types == [LINEAR] * 3 + [FULL]  # interval 4


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]}, "unsupported"),
    ({"layer_types": ["full_attention"]}, "1 entries for 4 layers"),
    ({"linear_num_value_heads": 6}, "not a multiple of linear_num_key_heads"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_config_refusals(changes, message):
    with pytest.raises(UserError, match=message):
        build_model(_config(NEXT, **changes))


def test_multimodal_config_is_its_text_model():
    a = build_model(_config(HUB)).args
    t = json.loads((HUB / "config.json").read_text())["text_config"]
    assert a.model_type == "qwen3_5_moe" and a.hidden_size == t["hidden_size"] and a.num_experts == 8
    assert a.rope["partial_rotary_factor"] == 0.25 and "mrope_section" not in a.rope
    text = build_model(_config(TEXT)).args
    assert text.model_type == "qwen3_5_moe_text" and text.tie_word_embeddings


def test_fused_expert_layout_gives_the_same_logits(tmp_path):
    # The hub stores Qwen3.5's experts fused: gate_up_proj [E, 2I, hidden]
    # (gate rows first) and down_proj [E, hidden, I]; read lazily as switch_mlp.
    from safetensors.numpy import load_file, save_file

    w = load_file(HUB / "model.safetensors")
    out, per = {}, {}
    for k, v in w.items():
        head, sep, tail = k.partition(".mlp.experts.")
        if sep:
            e, proj = tail.split(".")[:2]
            per.setdefault(head, {})[(int(e), proj)] = v
        else:
            out[k] = v
    for head, d in per.items():
        E = 1 + max(e for e, _ in d)
        out[f"{head}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([d[(e, "gate_proj")], d[(e, "up_proj")]]) for e in range(E)])
        out[f"{head}.mlp.experts.down_proj"] = np.stack([d[(e, "down_proj")] for e in range(E)])
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(HUB / "config.json", tmp_path / "config.json")
    ref = np.load(HUB / "reference.npz")
    r = compare(sequence_logits(load_model(tmp_path).model, ref["ids"], prefill_step=7), ref["logits"], FP32_REL_TOL)
    assert r["ok"], r


@pytest.mark.parametrize("family", list(MLX_LM))
def test_mlx_lm_4bit_checkpoint_matches_mlx_lm_at_np1(family):
    """mlx_lm.convert's 4-bit checkpoint (conv1d [C, K, 1], norms stored as
    1 + w, switch_mlp experts quantized, 8-bit router and shared-expert gate)
    in every feeding mode."""
    d = MLX_LM[family]
    ref = np.load(d / "mlx_lm_reference.npz")
    model = load_model(d).model
    layer = model.layers[0]
    assert "scales" in layer.linear_attn.out_proj and type(layer.mlp.switch_mlp.gate_proj).__name__ == \
        "QuantizedSwitchLinear"
    assert type(layer.input_layernorm).__name__ == "RMSNormFP32Scale"
    for mode, logits in all_mode_logits(model, ref["ids"]).items():
        r = compare(logits, ref["logits"], FP32_REL_TOL)
        assert r["ok"], (mode, r)


@pytest.mark.parametrize("family", list(MLX_LM))
def test_mlx_lm_4bit_checkpoint_matches_mlx_lm_at_np2(tmp_path, family):
    d = MLX_LM[family]
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", str(d), "--np", "2", "--backend", "mpi",
                 "--reference", str(d / "mlx_lm_reference.npz")], timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "np2 vs reference" in p.stdout and " NO" not in p.stdout


@pytest.mark.parametrize("d", [NEXT, TEXT], ids=["qwen3_next", "qwen3_5_moe"])
def test_deltanet_split_by_key_head_groups(d):
    # 3 ranks of 4 key heads: 2, 1, 1 key heads with their value heads; the
    # fused in_proj_qkvz by whole key heads, in_proj_qkv in three ranges.
    def plan(r):
        m = build_model(_config(d))
        m.shard(Group.planned(3, r))
        return m, collect_plan(m)

    m0, p0 = plan(0)
    a = m0.args
    Hk, Hv, Dk, Dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    i = a.layer_types.index(LINEAR)
    pre = f"model.layers.{i}.linear_attn."
    for r, (k0, k1) in enumerate([(0, 2), (2, 3), (3, 4)]):
        m, p = plan(r)
        la = m.layers[i].linear_attn
        m_ = Hv // Hk
        assert (la.num_k_heads, la.num_v_heads) == (k1 - k0, m_ * (k1 - k0))
        qkv = [(k0 * Dk, k1 * Dk), (Hk * Dk + k0 * Dk, Hk * Dk + k1 * Dk),
               (2 * Hk * Dk + m_ * k0 * Dv, 2 * Hk * Dk + m_ * k1 * Dv)]
        assert p[pre + "conv1d.weight"] == (0, qkv)
        assert p[pre + "A_log"] == p[pre + "dt_bias"] == (0, [(m_ * k0, m_ * k1)])
        assert p[pre + "out_proj.weight"] == (1, [(m_ * k0 * Dv, m_ * k1 * Dv)])
        if la.fused:
            w = 2 * Dk + 2 * m_ * Dv
            assert p[pre + "in_proj_qkvz.weight"] == (0, [(k0 * w, k1 * w)])
        else:
            assert p[pre + "in_proj_qkv.weight"] == (0, qkv)
        assert pre + "norm.weight" not in p  # the gated norm (per head dim) stays whole
    with pytest.raises(UserError, match="5 ranks cannot split"):
        build_model(_config(d)).shard(Group.planned(5, 0))


def test_collectives_per_token_counts_the_moe_all_sum():
    m = build_model(_config(NEXT))
    m.shard(Group.planned(2, 0))
    calls, _ = m.collectives_per_token()["all_sum"]
    # an all_sum per DeltaNet out_proj (3), attention o_proj (1), dense down_proj (1) and MoE block (3)
    assert calls == 8


def test_compiled_decode_holds_the_state_in_static_buffers(monkeypatch):
    # decode.StaticState: the DeltaNet conv + recurrent state are buffers of
    # the compiled step (replaced in the graph), bit for bit the eager
    # DeltaNetCache steps' logits over buffer regrowths
    import mlxcel_dist.engine.decode as decode

    monkeypatch.setattr(decode, "STEP", 8)
    model = load_model(NEXT).model
    ids = np.load(NEXT / "reference.npz")["ids"]
    cache = model.make_cache()
    model(mx.array(ids[:3])[None], cache)
    eager = np.stack([np.array(model(mx.array([[int(t)]]), cache)[0, -1]) for t in ids[3:]])
    got = sequence_logits(model, ids, decode_from=3)[3:]
    assert np.array_equal(got, eager) and 1 <= model.engine.traces < 8
    assert model.engine.static and model.engine.kinds[:2] == ["state", "state"]


def _engine(model, prompt_cache=None):
    from mlxcel_dist.engine.batch import BatchEngine

    return BatchEngine(model, prompt_cache=prompt_cache)


def test_batched_rows_give_the_ids_alone():
    # DeltaNet state in the batch buffers (decode.StaticState): the rows step together.
    model = load_model(NEXT).model
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, model.args.vocab_size, k) for k in (5, 11, 8)]
    eng = _engine(model)
    eng.add_many([(i, p, None) for i, p in enumerate(prompts)])
    assert eng.static and eng.stateful
    got = {i: [] for i in range(len(prompts))}
    for _ in range(6):
        for rid, tok in eng.step().items():
            got[rid].append(tok)
    assert [got[i] for i in range(3)] == [list(Generation(model, p, 6, eos_ids=())) for p in prompts]


def test_prompt_cache_restores_the_states_exactly():
    # Multi-turn: the second prompt starts with the first prompt and its
    # reply; the entry's DeltaNet snapshots and KV are restored as they were,
    # so the tokens are those of the prompt alone.
    from mlxcel_dist.engine.prompt_cache import PromptCache

    model = load_model(HUB).model
    V = model.args.vocab_size
    rng = np.random.default_rng(5)
    first = rng.integers(3, V, 21)
    pc = PromptCache()
    eng = _engine(model, pc)
    eng.add("a", first)
    reply = [eng.step()["a"] for _ in range(5)]
    eng.remove("a")
    # the prompt's entry (all but its last token) and, kept at removal, the prompt and reply fed
    assert sorted(len(k) for k in pc.entries) == [len(first) - 1, len(first) + len(reply)]
    second = np.concatenate([first, reply, rng.integers(3, V, 6)])
    eng.add("b", second)
    got = [eng.step()["b"] for _ in range(6)]
    eng.remove("b")
    assert pc.hits == 1 and not pc.trimmable
    assert got == list(Generation(model, second, 6, eos_ids=()))
    # every entry holds each DeltaNet layer's snapshot (conv + recurrent state) after exactly its tokens
    for key, (layers, _) in pc.entries.items():
        snaps = [kv for kv, kind in zip(layers, model.args.layer_types) if kind == LINEAR]
        assert snaps and all(s.state[2] == len(key) for s in snaps)
    # the same prompt again: its cached prefix restores the states, the same tokens
    eng.add("c", second)
    assert [eng.step()["c"] for _ in range(6)] == got and pc.hits == 2


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    """qwen3_next/hybrid_fp32 with a word-level tokenizer of its 256 ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("qwen3_next") / "model"
    shutil.copytree(NEXT, d)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, 256)}}
    t = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.decoder = decoders.WordPiece()
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    return d


def _complete(base, body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_serve_batched_text_is_the_text_alone(served_dir, tmp_path):
    """Served at np 2: 4 concurrent greedy clients get the text `generate`'s
    loop gives each prompt alone (np 1); so does a prompt extending an earlier
    prompt and its reply (served from that prompt-cache entry's restored
    states). (np 1 serves through the same engine calls on one rank.)"""
    from serveproc import Server

    from mlxcel_dist.engine.generation import generate_text
    from mlxcel_dist.engine.sampling import SamplingParams
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    loaded = load_model(served_dir)
    tok = Tokenizer(loaded.model_dir, loaded.config)

    def alone(p):
        return "".join(generate_text(loaded.model, tok, tok.prompt_ids(p), 8, SamplingParams(temp=0.0)))

    prompts = ["w17 w33 w90 w120", "w5 w250 w7", "w40 w41 w42 w43 w44 w45", "w9"]
    want = [alone(p) for p in prompts]
    assert len(set(want)) > 2, want
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts]
    s = Server(served_dir, 2, tmp_path)
    try:
        assert [_complete(s.base, b) for b in bodies] == want
        got = [None] * len(bodies)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(s.base, bodies[i])))
                   for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert got == want
        longer = prompts[0] + want[0] + " w3 w4"
        assert _complete(s.base, {**bodies[0], "prompt": longer}) == alone(longer)
    finally:
        rc = s.stop()
    assert rc in (0, 143), rc


@pytest.mark.parametrize("d", [NEXT, HUB], ids=["qwen3_next", "qwen3_5_moe"])
def test_our_4bit_conversion_is_what_mlx_lm_runs(tmp_path, d):
    """`convert --quantize` writes what mlx-lm's own model reads (qwen3_next:
    its conv / norm layout and rope keys; qwen3_5_moe: mlx-lm converts the HF
    layout itself) and what we read back: the same logits, every mode alike."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model as mlx_lm_load

    from mlxcel_dist.checkpoint.convert import convert_checkpoint

    out = convert_checkpoint(d, tmp_path / "q4", quantize=True, bits=4, group_size=32)["out"]
    ids = np.load(d / "reference.npz")["ids"]
    m, _ = mlx_lm_load(out)
    ref = np.array(m(mx.array(ids)[None])[0].astype(mx.float32))
    ours = load_model(out).model
    assert "scales" in ours.layers[0].linear_attn.out_proj
    # the router and the shared expert's gate at 8 bits, as mlx_lm.convert writes them (keyed by
    # mlx-lm's module paths: the multimodal qwen3_5_moe wraps the text model in language_model)
    q = json.loads((out / "config.json").read_text())["quantization"]
    at = "" if d == NEXT else "language_model."
    assert q[f"{at}model.layers.0.mlp.gate"] == q[f"{at}model.layers.0.mlp.shared_expert_gate"] == {
        "group_size": 64, "bits": 8}
    assert ours.layers[0].mlp.gate.bits == 8 and ours.layers[0].linear_attn.out_proj.bits == 4
    for mode, logits in all_mode_logits(ours, ids).items():
        r = compare(logits, ref, FP32_REL_TOL)
        assert r["ok"], (mode, r)
