"""LoRA / DoRA adapters (`--adapter-path`, lora.py) against mlx-lm's logits
with the same adapter: two adapters trained by `mlx_lm lora` on the embedded
default model (tests/fixtures/lora, scripts/fixtures_lora.py, with mlx-lm's
logits committed for a CI without mlx-lm), in every feeding mode, at np 1,
np 2 (A/B cut with their layers) and pp 2 under the real launcher; against
an installed mlx-lm on other ids; `convert --adapter-path`; serve; and the
refusals (one `error:` line, exit 2, before any rank starts)."""

import json
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mlxcel_dist.cli import app
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.harness import FP32_REL_TOL, compare, modes
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.nn.lora import Adapter, LoRALinear
from serveproc import Server
from testproc import run_cmd

LORA = Path(__file__).parent / "fixtures" / "lora"
CASES = sorted(p.name for p in LORA.iterdir() if p.is_dir())
runner = CliRunner()


def _ref(case):
    with np.load(LORA / case / "mlx_lm_logits.npz") as z:
        return z["ids"], z["logits"], z["base"]


@pytest.mark.parametrize("case", CASES)
def test_adapter_gives_mlx_lm_logits_in_every_mode(case):
    ids, ref, base = _ref(case)
    model = load_model(default_model_dir(), adapter=Adapter(LORA / case)).model
    wrapped = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == len(Adapter(LORA / case).layers)
    for mode, kw in modes(32, len(ids)).items():
        for compiled in (True, False):
            r = compare(sequence_logits(model, ids, compiled=compiled, **kw), ref, FP32_REL_TOL)
            assert r["ok"], (mode, compiled, r)
    assert not compare(base, ref, FP32_REL_TOL)["ok"]  # the adapter is what is compared


def test_against_an_installed_mlx_lm_on_other_ids():
    pytest.importorskip("mlx_lm")
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from fixtures_lora import exact_logits
    from mlx_lm import load

    ids = np.random.default_rng(7).integers(3, 512, 30).astype(np.int32)
    for case in CASES:
        theirs, _ = load(str(default_model_dir()), adapter_path=str(LORA / case))
        ours = load_model(default_model_dir(), adapter=Adapter(LORA / case)).model
        r = compare(sequence_logits(ours, ids, decode_from=10), exact_logits(theirs, ids), FP32_REL_TOL)
        assert r["ok"], (case, r)


def test_convert_fuses_the_adapter(tmp_path):
    for case in CASES:
        out = tmp_path / case
        r = runner.invoke(app, ["convert", str(default_model_dir()), str(out), "--adapter-path", str(LORA / case)])
        assert r.exit_code == 0, r.output
        ids, ref, _ = _ref(case)
        assert compare(sequence_logits(load_model(out).model, ids), ref, FP32_REL_TOL)["ok"], case


def _copy(tmp_path, case="lora_last2"):
    d = tmp_path / "adapter"
    shutil.copytree(LORA / case, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "adapter_config.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _rename_tensor(d, old, new):
    import mlx.core as mx

    w = mx.load(str(d / "adapters.safetensors"))
    w[new] = w.pop(old)
    mx.save_safetensors(str(d / "adapters.safetensors"), w)


BAD = {
    "missing": (lambda d: shutil.rmtree(d), "no such directory"),
    "no weights": (lambda d: (d / "adapters.safetensors").unlink(), "no adapters.safetensors"),
    "bad json": (lambda d: (d / "adapter_config.json").write_text("{"), "not a JSON file"),
    "full": (lambda d: _edit_config(d, fine_tune_type="full"), "fine_tune_type 'full' is not an adapter"),
    "alpha": (lambda d: _edit_config(d, lora_parameters={"scale": None, "alpha": 16}), "scale, not alpha"),
    "rank": (lambda d: _edit_config(d, lora_parameters={"rank": 8}), "not [in, 8] and [8, out]"),
    "no layer 7": (lambda d: [_rename_tensor(d, f"model.layers.3.mlp.up_proj.{x}", f"model.layers.7.mlp.up_proj.{x}")
                              for x in ("lora_a", "lora_b")], "model.layers.7.mlp.up_proj, which this model does not "
                                                              "have (its layers are 0..3)"),
    "embedding": (lambda d: [_rename_tensor(d, f"model.layers.3.mlp.up_proj.{x}", f"model.embed_tokens.{x}")
                             for x in ("lora_a", "lora_b")], "model.embed_tokens is a Embedding"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_adapters_are_one_line_before_launch(tmp_path, what):
    d = _copy(tmp_path)
    edit, message = BAD[what]
    edit(d)
    for args in (["generate", "--np", "2"], ["serve"], ["convert", str(default_model_dir()), str(tmp_path / "out")]):
        r = runner.invoke(app, [*args, "--adapter-path", str(d)])
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr.startswith("error: ") and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_an_adapter_for_another_model_is_refused(tmp_path):
    llama = Path(__file__).parent / "fixtures" / "llama" / "gqa_fp32"
    np.save(tmp_path / "ids.npy", np.arange(3, 9))
    r = runner.invoke(app, ["logits", str(llama), "--tokens-file", str(tmp_path / "ids.npy"), "--out",
                            str(tmp_path / "x.npy"), "--adapter-path", str(LORA / "lora_last2")])
    assert r.exit_code == 2 and "model.layers.2.mlp.down_proj is [64, 128] but the adapter is for [128, 384]" in r.stderr, r.output


# Real launcher ----------------------------------------------------------------------------------
def _cli():
    exe = Path(sys.executable).parent / "mlxcel-dist"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mlxcel_dist.cli"]


@pytest.mark.parametrize("case,split", [("dora_keys", ["--np", "2"]), ("lora_last2", ["--pp", "2"])])
def test_np2_and_pp2_give_mlx_lm_logits(tmp_path, case, split):
    # np 2: q/k/v and the MLP's B cut by rows, o_proj / down_proj's A by columns (DoRA: the row norms'
    # all_sum at load); pp 2: each stage adapts its own layers (lora_last2's are all on the second)
    ids, ref, _ = _ref(case)
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "x.npy"
    p = run_cmd(_cli() + ["logits", str(default_model_dir()), "--tokens-file", str(tmp_path / "ids.npy"),
                          "--out", str(out), "--adapter-path", str(LORA / case), "--decode-from", "9", *split,
                          "--backend", "mpi"], timeout=300)
    assert p.returncode == 0, p.stderr
    assert compare(np.load(out), ref, FP32_REL_TOL)["ok"]


def test_np2_serve_with_an_adapter_a_bound_and_an_extra_eos(tmp_path):
    # one server: the adapter, --max-kv-size (batch rings of 12 slots) and --extra-eos-token at np 2;
    # its greedy completions are generate's at np 1 with the same options
    opts = ["--adapter-path", str(LORA / "lora_last2"), "--max-kv-size", "12", "--extra-eos-token", "."]
    prompts = ["The red boat", "A green sea and the harbour"]
    want = []
    for p in prompts:
        r = runner.invoke(app, ["generate", "--ignore-chat-template", "-p", p, "-n", "24", *opts])
        assert r.exit_code == 0, r.output
        want.append(r.stdout[len(p):].rstrip("\n"))
    s = Server(default_model_dir(), 2, tmp_path, extra=opts)
    try:
        got = [s.json("/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0})["choices"][0]
               for p in prompts]
    finally:
        assert s.stop() in (0, 128 + signal.SIGTERM)  # (mpirun's code on the SIGTERM that stops it)
    assert [c["text"] for c in got] == want
    assert any(c["finish_reason"] == "stop" for c in got)  # the extra EOS ended one


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """The default model MLX-quantized (4 bits, groups of 64: QLoRA's base)."""
    out = tmp_path_factory.mktemp("q4") / "m"
    r = runner.invoke(app, ["convert", str(default_model_dir()), str(out), "--quantize"])
    assert r.exit_code == 0, r.output
    return out


def test_on_a_quantized_base_against_an_installed_mlx_lm(q4):
    pytest.importorskip("mlx_lm")
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from fixtures_lora import exact_logits
    from mlx_lm import load

    ids = np.random.default_rng(8).integers(3, 512, 30).astype(np.int32)
    for case in CASES:
        theirs, _ = load(str(q4), adapter_path=str(LORA / case))
        ours = load_model(q4, adapter=Adapter(LORA / case)).model
        assert all("scales" in m.base for _, m in ours.named_modules() if isinstance(m, LoRALinear))
        r = compare(sequence_logits(ours, ids, decode_from=10), exact_logits(theirs, ids), FP32_REL_TOL)
        assert r["ok"], (case, r)


def test_np2_on_a_quantized_base_matches_np1(q4, tmp_path):
    # packed input columns of o_proj / down_proj cut A's rows; DoRA's norms of dequantized weights
    ids = np.random.default_rng(9).integers(3, 512, 30).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    one = sequence_logits(load_model(q4, adapter=Adapter(LORA / "dora_keys")).model, ids, decode_from=10)
    out = tmp_path / "x.npy"
    p = run_cmd(_cli() + ["logits", str(q4), "--tokens-file", str(tmp_path / "ids.npy"), "--out", str(out),
                          "--adapter-path", str(LORA / "dora_keys"), "--decode-from", "10", "--np", "2",
                          "--backend", "mpi"], timeout=300)
    assert p.returncode == 0, p.stderr
    assert compare(np.load(out), one, FP32_REL_TOL)["ok"]
