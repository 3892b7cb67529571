"""engine/warmup.py: a fresh CUDA machine's decode kernels compiled in a helper
process beside the run. The compiling itself happens only on a CUDA GPU
(docs/benchmarks.md measures it); here: the helper's small model for each kind
of checkpoint runs the engine's steps, kernels are published atomically and
names-first, and the helper starts once per machine and model, never off CUDA."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxcel_dist.checkpoint.loader import open_model
from mlxcel_dist.engine import warmup

FIXTURES = Path(__file__).parent / "fixtures"


def test_shrink_cuts_the_layer_count_and_every_per_layer_list():
    cfg = {"num_hidden_layers": 6, "layer_types": ["a", "b"] * 3, "mlp_only_layers": [0, 5], "vocab_size": 6,
           "text_config": {"num_hidden_layers": 6, "layer_types": ["x"] * 6}}
    out = warmup.shrink(cfg, 2)
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["a", "b"]
    assert out["mlp_only_layers"] == [0] and out["vocab_size"] == 6  # layer indices kept below the cut; the rest as is
    assert out["text_config"] == {"num_hidden_layers": 2, "layer_types": ["x", "x"]}
    assert cfg["num_hidden_layers"] == 6 and len(cfg["layer_types"]) == 6  # the caller's config untouched
    hub = {"num_hidden_layers": 4, "num_nextn_predict_layers": 1, "layer_types": list("abcde"), "moe_layers_enum": "1,2,3",
           "per_layer_config": {"1": {"head_dim": 8}, "3": {}}, "num_kv_shared_layers": 2, "eos_token_id": [1, 2, 3]}
    assert warmup.shrink(hub, 2) == {"num_hidden_layers": 2, "num_nextn_predict_layers": 1, "layer_types": ["a", "b"],
                                     "moe_layers_enum": "1", "per_layer_config": {"1": {"head_dim": 8}},
                                     "num_kv_shared_layers": 0, "eos_token_id": [1, 2, 3]}
    assert warmup.shrink({"num_hidden_layers": 1}, 2) == {"num_hidden_layers": 1}


@pytest.mark.parametrize("case, layers", [
    ("qwen3_next/hybrid_fp32", 4),   # three linear-attention layers, then the first full one
    ("deepseek_v3/yarn_fp32", 2),    # first_k_dense_replace 1: one dense layer, then the first MoE one
    ("gemma3/gqa_fp32", None),       # five sliding layers, then the first global one (or all it has)
])
def test_the_helper_keeps_the_first_layer_of_every_kind(case, layers):
    ck = open_model(FIXTURES / case)
    n = warmup.helper_layers(ck.config, ck.args)
    types = list(ck.args.layer_types)
    assert set(types[:n]) == set(types)
    if layers is not None:
        assert n == layers
    assert n == min(len(types), max(2, *(types.index(t) + 1 for t in set(types)),
                                    int(ck.config.get("first_k_dense_replace") or 0) + 1))


@pytest.mark.parametrize("case", ["mlx_lm/qwen3_moe_q4", "mlx_lm/qwen3_next_q4", "mlx_lm/deepseek_v3_q4",
                                  "gemma3/gqa_bf16"])
def test_the_helper_runs_the_engine_on_a_small_zero_model(case, tmp_path):
    """Quantized as the checkpoint (the same layers quantized, the same bits),
    its dtype, zero weights, fewer layers; the one-token forward and the
    engine's decode steps run and the marker is written (on the CPU nothing
    is compiled, so nothing is published)."""
    src = FIXTURES / case
    ck = open_model(src)
    dtype = ck.dtype or mx.float32
    m = warmup.build_small(src, dtype)
    names = dict(tree_flatten(m.parameters()))
    assert len(m.layers if hasattr(m, "layers") else m.model.layers) == warmup.helper_layers(ck.config, ck.args)
    assert all(not mx.any(p).item() for p in names.values())
    assert {str(p.dtype) for p in names.values() if mx.issubdtype(p.dtype, mx.floating)} == {str(dtype)}
    if ck.quantization is not None:  # the same layers quantized as the whole model's first ones, with its bits
        n = warmup.helper_layers(ck.config, ck.args)
        full = dict(tree_flatten(ck.build()[0].parameters()))  # (lazy: nothing read)
        want = {k: full[k].shape for k in full if k.endswith(".scales") and (warmup._layer_index(k) or 0) < n}
        assert want and {k: p.shape for k, p in names.items() if k.endswith(".scales")} == want
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir(), private.mkdir()
    marker = shared / ".marker"
    assert warmup.run_helper(str(src), str(dtype).split(".")[-1], shared, private, marker) == []
    assert marker.exists()


def _kernel(d: Path, name: str, text: str = "ptx") -> Path:
    p = d / f"{name}.ptx"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    p.with_suffix(".txt").write_text(f"{name}\tmangled_{name}\n")
    return p


def test_publish_copies_only_new_kernels_names_first_and_atomically(tmp_path, monkeypatch):
    private, shared = tmp_path / "p", tmp_path / "s"
    _kernel(private, "qmm_m16")
    _kernel(private, "a" * 245 + "/tail")  # MLX's long names: a folder per 245 characters
    _kernel(private, "gather", "new")
    _kernel(shared, "gather", "old")
    replaced = []
    real = os.replace
    monkeypatch.setattr(warmup.os, "replace", lambda a, b: (replaced.append(Path(b).name), real(a, b)))
    done = warmup.publish(private, shared)
    assert sorted(done) == sorted(["qmm_m16.ptx", "a" * 245 + "/tail.ptx"])
    assert replaced == ["tail.txt", "tail.ptx", "qmm_m16.txt", "qmm_m16.ptx"]  # each kernel's names before it
    assert (shared / "gather.ptx").read_text() == "old"  # there already: left as it is
    assert (shared / "qmm_m16.txt").read_text() == "qmm_m16\tmangled_qmm_m16\n"
    assert not [p for p in shared.rglob("*") if p.name.endswith(".tmp")]
    assert warmup.publish(private, shared) == []


def test_the_helper_runs_only_where_it_fits_beside_the_model():
    sizes = {"model.embed_tokens.weight": 10, "model.layers.0.mlp.weight": 20, "model.layers.1.mlp.weight": 20,
             "model.layers.2.mlp.weight": 20, "lm_head.weight": 10}
    assert warmup.fits(sizes, 2, 1, None)  # no memory figure (not CUDA): nothing to guard
    assert warmup.fits(sizes, 2, 1, 200)  # 80 + 60 of 170 allowed
    assert not warmup.fits(sizes, 2, 1, 160)  # 140 of 136
    assert warmup.fits(sizes, 2, 4, 160)  # a quarter of the model a rank: 20 + 60


def test_start_only_on_cuda_once_per_model_and_machine(tmp_path, monkeypatch):
    src = FIXTURES / "gemma3" / "gqa_fp32"
    assert warmup.start(src, "float32") is None  # this machine's MLX does not run on CUDA
    started = []

    class Popen:
        def __init__(self, argv, **kw):
            started.append((argv, kw["env"]))

        def poll(self):
            return 0

    monkeypatch.setattr(warmup, "on_cuda", lambda: True)
    monkeypatch.setattr(warmup.subprocess, "Popen", Popen)
    monkeypatch.setattr(warmup.atexit, "register", lambda f: None)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setenv("MLXCEL_DIST_WORLD", "x")
    monkeypatch.setenv("MLXCEL_DIST_INJECT_FAULT", "kill:0:load")
    assert warmup.start(src, "float32") is not None
    argv, env = started[0]
    assert env["MLX_PTX_CACHE_DIR"] != str(tmp_path / "ptx") and env["MLXCEL_DIST_WARMUP"] == "0"
    assert "MLXCEL_DIST_WORLD" not in env  # the helper is a plain process, never a rank
    assert "MLXCEL_DIST_INJECT_FAULT" not in env  # a test's fault is for the rank, not its helper
    assert argv[-3] == str(tmp_path / "ptx") and argv[-4] == "float32"
    assert warmup.start(src, "float32") is None  # one running (its lock)
    lock = next((tmp_path / "ptx").glob(".mlxcel-warmup-*.lock"))
    old = lock.stat().st_mtime - warmup.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert warmup.start(src, "float32") is not None  # a killed run's lock: taken over
    Path(argv[-1]).write_text("{}")  # that one finished: its marker
    lock.unlink()
    assert warmup.start(src, "float32") is None
    assert warmup.start(src, "bfloat16") is not None  # another dtype: other kernels
    assert warmup.start(tmp_path / "no-such-model", "float32") is None  # the load says what is wrong, not this
    monkeypatch.setattr(warmup.mx, "device_info", lambda: {"total_memory": 1000})
    assert warmup.start(src, "float16") is None  # the model alone fills this GPU
    monkeypatch.setenv("MLXCEL_DIST_WARMUP", "0")
    assert warmup.start(FIXTURES / "llama" / "gqa_fp32", "float32") is None
    assert len(started) == 3


def test_the_started_helper_runs_and_leaves_its_marker(tmp_path, monkeypatch):
    """The real process `start` spawns (here on the CPU, where it compiles
    nothing): it runs the small model through the engine and writes the
    marker, so a later run starts none; the run's end removes its lock and
    its own cache directory."""
    src = FIXTURES / "mlx_lm" / "qwen3_moe_q4"
    stops = []
    monkeypatch.setattr(warmup, "on_cuda", lambda: True)
    monkeypatch.setattr(warmup.atexit, "register", stops.append)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    p = warmup.start(src)
    assert p.wait(timeout=120) == 0
    private = Path(p.args[-2])
    marker = Path(p.args[-1])
    assert marker.parent == tmp_path / "ptx" and json.loads(marker.read_text()) == {"published": []}  # CPU: no kernel
    assert private.exists()
    stops[0]()
    assert not private.exists() and not list((tmp_path / "ptx").glob("*.lock"))
    assert warmup.start(src) is None  # its marker: done on this machine


@pytest.mark.parametrize("case, flat", [("gemma3/gqa_bf16", True), ("mlx_lm/qwen3_next_q4", False)])
def test_the_helpers_serve_phase_runs_a_mixed_step_and_two_rows(case, flat, monkeypatch):
    """The helper's server steps: a prompt admitted beside a decoding row rides
    in its forward where the family's rows can (flat steps, as on a GPU: forced
    here on the CPU), not where a state cache keeps it apart (qwen3_next); both
    rows then step together."""
    monkeypatch.setenv("MLXCEL_DIST_FLAT", "1")
    src = FIXTURES / case
    m = warmup.build_small(src, open_model(src).dtype or mx.float32)
    flat_steps, most = warmup.serve_phase(m, prompt=12)
    assert (flat_steps > 0) == flat and most == 2


@pytest.mark.parametrize("case", ["baichuan_m1/mqa_conv3_fp32", "gemma3n/gqa_fp32", "gemma4/moe_fp32",
                                  "step3p5/hub_layout_fp32", "diffusion_gemma/moe_fp32"])
def test_the_helper_builds_families_whose_configs_index_their_layers(case):
    """Configs that name layers by index (baichuan_m1's sliding_window_layers,
    gemma4's per_layer_config, step3p5's moe_layers_enum and its MTP-padded
    lists) or share KV across the last layers (gemma3n, gemma4): the small
    model builds with fewer layers and runs a forward (session 31's helper
    failed on these)."""
    src = FIXTURES / case
    ck = open_model(src)
    m = warmup.build_small(src, ck.dtype or mx.float32)
    n = warmup.helper_layers(ck.config, ck.args)
    assert n < (ck.config.get("text_config") or ck.config)["num_hidden_layers"]
    assert len(m.layers if hasattr(m, "layers") else m.model.layers) == n
    assert m(mx.array([[1, 2]]), cache=m.make_cache()).shape[:2] == (1, 2)
