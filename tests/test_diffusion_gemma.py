"""DiffusionGemma specifics the per-family runners cannot see (they check the
encoder's causal LM logits): the canvas decoder's logits with and without
self-conditioning, the greedy block-diffusion run against transformers'
`generate`, at np 1 and under TP (np 2, MPI), config refusals and the
checkpoint names sanitize drops."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, compare
from mlxcel_dist.checkpoint.loader import load_model
from mlxcel_dist.models.diffusion_gemma import Model, ModelArgs

from reference_cases import FIXTURES, cases

CASES = cases("diffusion_gemma")
CANVAS_KEYS = ("logits_canvas", "logits_canvas_sc", "logits_canvas_short")


def noise_ids(k: int, C: int, V: int) -> np.ndarray:
    """scripts/fixtures_diffusion_gemma.py's deterministic random canvases."""
    i = np.arange(C, dtype=np.int64) + np.int64(k) * C
    return (i * 2654435761 + 12345) % (1 << 32) % V


def canvas_outputs(model, z) -> dict:
    """The decoder's canvas logits [C, V] for the fixture's three references."""
    out = {}
    for key in CANVAS_KEYS:
        prompt = z["ids"][: int(z["short_len"][0])] if key.endswith("short") else z["ids"]
        cache = model.make_cache()
        model.model(mx.array(prompt)[None], cache)
        sc = mx.array(z["sc_logits"])[None] if key.endswith("_sc") else None
        out[key] = np.array(model.canvas_logits(mx.array(z["canvas_ids"])[None], cache, sc)[0])
    return out


def greedy_ids(model, z):
    p = z["gen_params"]
    calls = [0]

    def noise(C):
        calls[0] += 1
        return noise_ids(calls[0] - 1, C, model.args.vocab_size)

    return model.block_diffusion(
        z["gen_prompt"], int(p[0]), max_denoising_steps=int(p[1]), entropy_bound=float(p[2]), t_min=float(p[3]),
        t_max=float(p[4]), stability_threshold=int(p[5]), confidence_threshold=float(p[6]), eos_ids=[int(p[7])],
        pad_id=int(p[8]), noise=noise,
    )  # fmt: skip


def test_fixtures_exercise_the_generation_loop():
    # one case stops a canvas early (confident), one ends at EOS (padded after it)
    runs = {d.name: np.load(d / "reference.npz") for d in CASES}
    moe, kv4 = runs["moe_fp32"], runs["kv4_fp32"]
    C = json.loads((FIXTURES / "diffusion_gemma" / "moe_fp32" / "config.json").read_text())["canvas_length"]
    assert moe["gen_passes"][0] < len(moe["gen_ids"]) // C * int(moe["gen_params"][1])
    eos, pad = int(kv4["gen_params"][7]), int(kv4["gen_params"][8])
    hit = list(kv4["gen_ids"]).index(eos)
    assert hit < len(kv4["gen_ids"]) - 1 and set(kv4["gen_ids"][hit + 1 :]) == {pad}


@pytest.mark.parametrize("d", CASES, ids=lambda d: d.name)
def test_canvas_logits_match_transformers(d):
    z = np.load(d / "reference.npz")
    got = canvas_outputs(load_model(d).model, z)
    for key in CANVAS_KEYS:
        r = compare(got[key], z[key], FP32_REL_TOL)
        assert r["ok"], (key, r)


@pytest.mark.parametrize("d", CASES, ids=lambda d: d.name)
def test_greedy_block_diffusion_matches_transformers_generate(d):
    z = np.load(d / "reference.npz")
    ids, passes = greedy_ids(load_model(d).model, z)
    assert ids == z["gen_ids"].tolist()
    assert passes == int(z["gen_passes"][0])


def test_tp_np2_canvas_logits_and_generation(tmp_path):
    from pathlib import Path

    from mlxcel_dist.cluster.launcher import find_mpirun, launch

    if find_mpirun() is None:
        pytest.fail("mpirun not found")
    helper = Path(__file__).parent / "helpers" / "diffusion_gemma_canvas.py"
    assert launch([str(tmp_path)] + [str(d) for d in CASES], 2, "mpi", script=str(helper)) == 0
    for d in CASES:
        z = np.load(d / "reference.npz")
        got = np.load(tmp_path / f"{d.name}.npz")
        for key in CANVAS_KEYS:
            r = compare(got[key], z[key], FP32_REL_TOL)
            assert r["ok"], (d.name, key, r)
        assert got["gen_ids"].tolist() == z["gen_ids"].tolist()
        assert int(got["gen_passes"][0]) == int(z["gen_passes"][0])


def test_generate_ids_hook_stops_at_eos_and_max_tokens():
    d = FIXTURES / "diffusion_gemma" / "moe_fp32"
    model = load_model(d).model
    prompt = np.load(d / "reference.npz")["gen_prompt"]
    seeded = type("S", (), {"seed": 7, "temp": 0.0})()
    full = list(model.generate_ids(prompt, 12, seeded, eos_ids=()))
    assert len(full) <= 12 and full == list(model.generate_ids(prompt, 12, seeded, eos_ids=()))
    if full:
        cut = list(model.generate_ids(prompt, 12, seeded, eos_ids=(full[2],)))
        assert cut == full[: full.index(full[2])]


def _config():
    return json.loads((FIXTURES / "diffusion_gemma" / "moe_fp32" / "config.json").read_text())


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(tie_word_embeddings=False), "untied"),
    (lambda c: c["text_config"].update(use_bidirectional_attention="all"), "bidirectional"),
    (lambda c: c.pop("text_config"), "text_config"),
    (lambda c: c["text_config"].update(num_experts=None), "num_experts"),
])  # fmt: skip
def test_unsupported_configs_are_refused(edit, match):
    c = _config()
    edit(c)
    with pytest.raises(UserError, match=match):
        ModelArgs.from_dict(c)


def test_config_forms_and_layer_shapes():
    a = ModelArgs.from_dict(_config())
    assert a.canvas_length == 8 and a.final_logit_softcapping == 30.0
    assert a.layer_heads == [(16, 2), (32, 1), (16, 2), (32, 1)]
    # the published form: global_head_dim / num_global_key_value_heads instead of per_layer_config
    c = _config()
    c["text_config"].pop("per_layer_config")
    c["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
    assert ModelArgs.from_dict(c).layer_heads == a.layer_heads


def test_sanitize_drops_the_vision_tower_and_tied_encoder_copies():
    m = Model(ModelArgs.from_dict(_config()))
    w = {
        "model.encoder.vision_tower.encoder.layers.0.mlp.weight": 0,
        "model.encoder.embed_vision.embedding_projection.weight": 0,
        "model.encoder.language_model.layers.0.layer_scalar": 1,
        "model.encoder.language_model.layers.0.mlp.up_proj.weight": 0,
        "model.encoder.language_model.norm.weight": 0,
        "lm_head.weight": 0,
        "model.decoder.norm.weight": 2,
    }
    assert m.sanitize(w) == {"model.encoder.language_model.layers.0.layer_scalar": 1, "model.decoder.norm.weight": 2}


def test_generate_text_runs_the_models_own_loop():
    # generation.generate_text takes a model's generate_ids (OneRowEngine) over the
    # batch engine's token-by-token steps: the CLI's generate runs block diffusion.
    from mlxcel_dist.engine.generation import generate_text
    from mlxcel_dist.engine.sampling import SamplingParams

    class Tok:  # ids as text, one character per id
        eos_ids = [1]

        @staticmethod
        def decode(ids):
            return "".join(chr(0x100 + int(i)) for i in ids)

    d = FIXTURES / "diffusion_gemma" / "moe_fp32"
    model = load_model(d).model
    prompt = np.load(d / "reference.npz")["gen_prompt"]
    sampling = SamplingParams(seed=3).validate()
    gen = generate_text(model, Tok, prompt, 10, sampling, context_tokens=0)
    chunks = []
    while True:
        try:
            chunks.append(next(gen))
        except StopIteration as done:
            stats = done.value
            break
    want = list(model.generate_ids(prompt, 10, sampling, eos_ids=[1]))
    assert stats.tokens == want and "".join(chunks) == Tok.decode(want)
    assert stats.finish_reason == ("length" if len(want) == 10 else "eos") and stats.checks >= 1
    with pytest.raises(UserError, match="logprobs"):
        next(generate_text(model, Tok, prompt, 4, sampling, logprobs=2))
