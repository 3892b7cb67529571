"""deepseek_v3 / kimi_k2: what the per-family runners do not see.

- the transformers-4 config form (config_t4.json: rope_theta, yarn
  rope_scaling with mscale / mscale_all_dim) gives the same logits as
  config.json, bit for bit;
- the kimi_k2 config (its own model_type) is served by this file;
- mlx-lm's layout (stacked `mlp.switch_mlp.*`, kv_b_proj split into
  `embed_q` / `unembed_out`) gives the same logits as transformers' per-expert
  layout, bit for bit, also per rank (np 2 on paper: the sanitized refs read a
  rank's slice);
- mlx-lm's own 4-bit checkpoint (tests/fixtures/mlx_lm/deepseek_v3_q4) gives
  mlx-lm's logits at np 1 (every feeding mode) and np 2;
- the dense / MoE layer rule (first_k_dense_replace, moe_layer_freq), `info`'s
  per-layer kinds and the config refusals.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, compare
from mlxcel_dist.checkpoint.loader import build_model, load_model
from mlxcel_dist.checkpoint.weights import open_checkpoint
from testproc import run_cmd

FIX = Path(__file__).parent / "fixtures" / "deepseek_v3"


def _logits(d: Path, ids) -> np.ndarray:
    return np.array(sequence_logits(load_model(d).model, ids))


@pytest.mark.parametrize("case", ["yarn_fp32", "no_qlora_fp32"])
def test_transformers4_config_form_loads_alike(tmp_path, case):
    src = FIX / case
    shutil.copyfile(src / "config_t4.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    t4 = json.loads((src / "config_t4.json").read_text())
    assert "rope_parameters" not in t4 and "rope_theta" in t4
    ids = np.load(src / "reference.npz")["ids"]
    assert np.array_equal(_logits(tmp_path, ids), _logits(src, ids))


def test_kimi_k2_config_is_served_here():
    model = load_model(FIX / "kimi_k2_fp32").model
    assert model.args.model_type == "kimi_k2" and type(model).__module__.endswith(".deepseek_v3")
    assert model.args.rope["rope_type"] == "yarn" and model.args.rope["factor"] == 4.0


def _mlx_lm_layout(src: Path, dst: Path) -> None:
    """The checkpoint as mlx-lm's sanitize stores it: experts stacked into
    switch_mlp, kv_b_proj split per head into embed_q (k rows, transposed) and
    unembed_out (v rows)."""
    cfg = json.loads((src / "config.json").read_text())
    H, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    w = dict(mx.load(str(src / "model.safetensors")))
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        kvb = w.pop(p + "self_attn.kv_b_proj.weight").reshape(H, nope + v, -1)
        out[p + "self_attn.embed_q.weight"] = mx.contiguous(kvb[:, :nope].swapaxes(1, 2))
        out[p + "self_attn.unembed_out.weight"] = mx.contiguous(kvb[:, nope:])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = [f"{p}mlp.experts.{e}.{proj}.weight" for e in range(cfg.get("n_routed_experts") or 0)]
            if keys and keys[0] in w:
                out[f"{p}mlp.switch_mlp.{proj}.weight"] = mx.stack([w.pop(k) for k in keys])
    out.update(w)
    assert not any(".experts." in k or "kv_b_proj" in k for k in out)
    mx.save_safetensors(str(dst / "model.safetensors"), out)
    shutil.copyfile(src / "config.json", dst / "config.json")


@pytest.mark.parametrize("case", ["yarn_fp32", "no_qlora_fp32"])
def test_mlx_lm_layout_loads_alike(tmp_path, case):
    src = FIX / case
    _mlx_lm_layout(src, tmp_path)
    ref = np.load(src / "reference.npz")
    ours = _logits(tmp_path, ref["ids"])
    assert np.array_equal(ours, _logits(src, ref["ids"]))
    assert compare(ours, ref["logits"], FP32_REL_TOL)["ok"]


def test_mlx_lm_quantized_split_loads_dequantized(tmp_path):
    """mlx-lm quantizes unembed_out (and embed_q) when their input dims are
    whole groups (real DeepSeek-V3 / Kimi K2: kv_lora 512): kv_b_proj is then
    rebuilt from the dequantized values, a float Linear whose logits are
    those of the same values stored unquantized, and a rank's head rows read
    alone (np 3 of 4 heads) equal the whole tensor's."""
    src = FIX / "no_qlora_fp32"  # kv_lora 32: unembed_out takes group size 32
    q_dir, f_dir = tmp_path / "quantized", tmp_path / "float"
    for d in (q_dir, f_dir):
        d.mkdir()
        _mlx_lm_layout(src, d)
    w = dict(mx.load(str(q_dir / "model.safetensors")))
    flat = dict(w)
    for name in [k for k in w if k.endswith("unembed_out.weight")]:
        q, scales, biases = mx.quantize(w[name], group_size=32, bits=8)
        w[name], w[name[:-6] + "scales"], w[name[:-6] + "biases"] = q, scales, biases
        flat[name] = mx.dequantize(q, scales, biases, group_size=32, bits=8)
    mx.save_safetensors(str(q_dir / "model.safetensors"), w)
    mx.save_safetensors(str(f_dir / "model.safetensors"), flat)
    cfg = json.loads((src / "config.json").read_text())
    (q_dir / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 32, "bits": 8}}))
    ref = np.load(src / "reference.npz")
    ours = _logits(q_dir, ref["ids"])
    assert np.array_equal(ours, _logits(f_dir, ref["ids"]))
    assert compare(ours, ref["logits"], 1e-2)["ok"]  # 8-bit v rows: near the float reference, not at fp32
    refs = build_model(cfg).sanitize(open_checkpoint(q_dir))
    kvb = refs["model.layers.0.self_attn.kv_b_proj.weight"]
    width = cfg["qk_nope_head_dim"] + cfg["v_head_dim"]
    whole = kvb.read()
    for rows in ([(0, 2 * width)], [(2 * width, 3 * width)], [(3 * width, 4 * width)]):
        assert mx.array_equal(kvb.read(0, rows), whole[rows[0][0] : rows[0][1]])


def test_sanitized_refs_read_a_ranks_slice(tmp_path):
    """Stacked experts and a rebuilt kv_b_proj read a rank's rows (uneven
    heads: np 3 of 8) exactly as the whole tensor's."""
    src = FIX / "yarn_fp32"
    _mlx_lm_layout(src, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    model = build_model(cfg)
    hf, mlx = model.sanitize(open_checkpoint(src)), model.sanitize(open_checkpoint(tmp_path))
    assert set(hf) == set(mlx)
    for name in ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.2.mlp.switch_mlp.gate_proj.weight",
                 "model.layers.2.mlp.switch_mlp.down_proj.weight"):
        a, b = hf[name], mlx[name]
        assert a.shape == b.shape and mx.array_equal(a.read(), b.read()), name
    width = cfg["qk_nope_head_dim"] + cfg["v_head_dim"]
    for rows in ([(0, 3 * width)], [(3 * width, 6 * width)], [(6 * width + 5, 8 * width)]):
        whole = hf["model.layers.1.self_attn.kv_b_proj.weight"].read()
        part = mlx["model.layers.1.self_attn.kv_b_proj.weight"].read(0, rows)
        assert mx.array_equal(part, whole[rows[0][0] : rows[0][1]])
    stacked = mlx["model.layers.2.mlp.switch_mlp.down_proj.weight"]
    assert mx.array_equal(hf["model.layers.2.mlp.switch_mlp.down_proj.weight"].read(2, [(5, 11)]),
                          stacked.read(2, [(5, 11)]))


def test_ranks_hold_their_heads_and_expert_slices():
    """np 3 on paper: heads 3/3/2 (q_b_proj, kv_b_proj rows, o_proj columns),
    latent projections whole, every expert's intermediate slice 6/5/5."""
    cfg = json.loads((FIX / "yarn_fp32" / "config.json").read_text())
    heads, inter = [], []
    for r in range(3):
        m = build_model(cfg)
        m.shard(Group.planned(3, r))
        a = m.layers[1].self_attn
        heads.append(a.num_heads)
        assert a.q_b_proj.weight.shape[0] == a.num_heads * 16 and a.kv_b_proj.weight.shape[0] == a.num_heads * 20
        assert a.o_proj.weight.shape[1] == a.num_heads * 12 and a.q_a_proj.weight.shape == (24, 64)
        assert a.kv_a_proj_with_mqa.weight.shape == (24, 64)
        inter.append(m.layers[1].mlp.switch_mlp.gate_proj.weight.shape[1])
        assert m.layers[1].mlp.gate.weight.shape == (8, 64)  # the router replicated
    assert heads == [3, 3, 2] and inter == [6, 5, 5]


def _args(**over):
    cfg = json.loads((FIX / "yarn_fp32" / "config.json").read_text())
    return build_model({**cfg, **over}).args


def test_dense_and_moe_layers():
    assert _args().mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    # DeepSeek's rule: MoE from first_k_dense_replace on, every moe_layer_freq-th layer
    assert _args(first_k_dense_replace=0, moe_layer_freq=2).mlp_layer_types == ["sparse", "dense", "sparse", "dense"]
    assert _args(n_routed_experts=None).mlp_layer_types == ["dense"] * 4


def test_info_names_each_layers_kind():
    lines = load_model(FIX / "yarn_fp32").model.describe_layers()
    assert len(lines) == 4 and "dense mlp" in lines[0] and all("moe 8 experts top-2" in l for l in lines[1:])
    assert all("yarn" in l and "MLA 8 heads" in l for l in lines)


def test_softmax_scale_takes_yarn_mscale_all_dim():
    a = _args()
    m = 0.1 * 1.0 * np.log(8.0) + 1.0
    assert a.softmax_scale == pytest.approx(16**-0.5 * m * m, rel=1e-12)
    assert _args(rope_parameters={"rope_type": "default", "rope_theta": 1e4}).softmax_scale == 16**-0.5


@pytest.mark.parametrize("over,message", [
    ({"topk_method": "greedy"}, "noaux_tc"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_layer_freq": 0}, "moe_layer_freq"),
])
def test_config_refusals(over, message):
    with pytest.raises(UserError, match=message):
        _args(**over)


MLX_LM = Path(__file__).parent / "fixtures" / "mlx_lm" / "deepseek_v3_q4"


def test_mlx_lm_4bit_checkpoint_matches_mlx_lm_at_np1():
    """mlx_lm.convert's 4-bit checkpoint (switch_mlp gate/up quantized,
    embed_q / unembed_out as mlx-lm splits kv_b_proj) in every feeding mode."""
    from mlxcel_dist.harness import all_mode_logits

    ref = np.load(MLX_LM / "mlx_lm_reference.npz")
    model = load_model(MLX_LM).model
    assert type(model.layers[1].mlp.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    for mode, logits in all_mode_logits(model, ref["ids"]).items():
        r = compare(logits, ref["logits"], FP32_REL_TOL)
        assert r["ok"], (mode, r)


def test_mlx_lm_4bit_checkpoint_matches_mlx_lm_at_np2(tmp_path):
    """Two ranks: 3 heads each, quantized expert rows and dense down columns split."""
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", str(MLX_LM), "--np", "2", "--backend", "mpi",
                 "--reference", str(MLX_LM / "mlx_lm_reference.npz")], timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "np2 vs reference" in p.stdout and " NO" not in p.stdout


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "per-head"])
@pytest.mark.parametrize("case", ["deepseek_v3/yarn_fp32", "deepseek_v3/no_qlora_fp32", "mlx_lm/deepseek_v3_q4"])
def test_both_caches_match_in_every_mode(monkeypatch, case, latent):
    """Either cache (LATENT_CACHE; the per-family runners see the default)
    gives the reference's logits in every feeding mode, compiled decode steps
    included. The latent cache holds kv_lora + rope values per token, one
    "head"; the per-head one H heads of nope + rope and v."""
    from mlxcel_dist.harness import all_mode_logits
    from mlxcel_dist.models import deepseek_v3

    d = FIX.parent / case
    ref = np.load(d / ("reference.npz" if (d / "reference.npz").exists() else "mlx_lm_reference.npz"))
    monkeypatch.setattr(deepseek_v3, "LATENT_CACHE", latent)
    model = load_model(d).model
    for mode, logits in all_mode_logits(model, ref["ids"]).items():
        r = compare(logits, ref["logits"], FP32_REL_TOL)
        assert r["ok"], (mode, r)
    cache = model.make_cache()
    model(mx.array(ref["ids"][:5])[None], cache)
    a = model.args
    keys, values = cache[0].state
    if latent:
        assert keys.shape[1] == values.shape[1] == 1 and keys.shape[-1] == a.kv_lora_rank
        assert values.shape[-1] == a.qk_rope_head_dim
    else:
        assert keys.shape[1] == values.shape[1] == a.num_attention_heads
        assert (keys.shape[-1], values.shape[-1]) == (a.q_head_dim, a.v_head_dim)


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "per-head"])
def test_our_quantized_conversion_runs_in_both_caches(tmp_path, monkeypatch, latent):
    """`convert --quantize` (group size 32) quantizes kv_b_proj and the stacked
    experts too; the absorbed decode step dequantizes kv_b_proj's rows, so
    every mode agrees with the one pass."""
    from mlxcel_dist.checkpoint.convert import convert_checkpoint
    from mlxcel_dist.harness import all_mode_logits
    from mlxcel_dist.models import deepseek_v3

    monkeypatch.setattr(deepseek_v3, "LATENT_CACHE", latent)
    out = convert_checkpoint(FIX / "no_qlora_fp32", tmp_path / "q4", quantize=True, bits=4, group_size=32)["out"]
    model = load_model(out).model
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    assert "scales" in attn.kv_b_proj and type(moe.switch_mlp.gate_proj).__name__ == "QuantizedSwitchLinear"
    ids = np.load(FIX / "no_qlora_fp32" / "reference.npz")["ids"]
    modes = all_mode_logits(model, ids)
    for mode, logits in modes.items():
        r = compare(logits, modes["one-pass"], FP32_REL_TOL)
        assert r["ok"], (mode, r)
    # the shared experts' down projection (32 inputs) is one group of 32: 2 ranks cannot cut it
    with pytest.raises(UserError, match="cannot split an expert down_proj's inputs"):
        load_model(out).model.shard(Group.planned(2, 1))
