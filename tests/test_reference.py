"""Per-family runner: every fixture, every feeding mode, against transformers."""

import shutil

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel_dist.engine import sequence_logits
from mlxcel_dist.loader import load_model

from reference_cases import BF16_REL_TOL, FP32_REL_TOL, case_id, cases, compare, modes, window_of

CASES = cases()


def _reference(d):
    ref = np.load(d / "reference.npz")
    bf16 = "logits_fp32" in ref
    return ref["ids"], ref["logits"], BF16_REL_TOL if bf16 else FP32_REL_TOL


@pytest.fixture(scope="module", params=CASES, ids=[case_id(d) for d in CASES])
def case(request):
    d = request.param
    return d, load_model(d).model


def test_fixtures_exist():
    assert len(CASES) >= 5


@pytest.mark.parametrize("mode", list(modes(16, 64)))
def test_matches_reference(case, mode):
    d, model = case
    ids, ref, tol = _reference(d)
    kw = modes(window_of(d), len(ids))[mode]
    r = compare(sequence_logits(model, ids, **kw), ref, tol)
    assert r["ok"], r


@pytest.mark.parametrize("d", [d for d in CASES if "bf16" in d.name], ids=case_id)
def test_bf16_checkpoint_in_fp32_is_exact(d):
    # --dtype float32 on a bf16 checkpoint computes in float32: every mode
    # gives transformers' float32 answer for the same bf16-rounded weights to
    # the float32 tolerance, which a half-precision computation cannot meet
    # (transformers' own bf16 run of these weights fails it).
    z = np.load(d / "reference.npz")
    assert "logits_fp32" in z.files, f"{case_id(d)}: a bf16 fixture needs logits_fp32"
    ids, exact, hf_bf16 = z["ids"], z["logits_fp32"], z["logits"]
    assert not compare(hf_bf16, exact, FP32_REL_TOL)["ok"], "the fp32 tolerance would not tell bf16 from fp32"
    loaded = load_model(d, dtype="float32")
    params = dict(tree_flatten(loaded.model.parameters()))
    assert {str(p.dtype) for p in params.values()} == {"mlx.core.float32"}
    for mode, kw in modes(window_of(d), len(ids)).items():
        r = compare(sequence_logits(loaded.model, ids, **kw), exact, FP32_REL_TOL)
        assert r["ok"], (mode, r)


@pytest.mark.parametrize("d", [d for d in CASES if "bf16" in d.name], ids=case_id)
def test_bf16_at_least_as_accurate_as_transformers_bf16(d):
    # Against the exact (fp32) answer for the same bf16 weights, our bf16 run
    # must be no further than transformers' own bf16 run.
    z = np.load(d / "reference.npz")
    ids, hf_bf16, exact = z["ids"], z["logits"], z["logits_fp32"]
    scale = np.abs(exact).max()
    hf_err = np.abs(hf_bf16 - exact).max() / scale
    model = load_model(d).model
    for kw in modes(window_of(d), len(ids)).values():
        ours = np.abs(sequence_logits(model, ids, **kw) - exact).max() / scale
        assert ours <= hf_err, (ours, hf_err)


@pytest.mark.parametrize("d", [d for d in CASES if (d / "config_t4.json").exists()], ids=case_id)
def test_transformers4_config_form(d, tmp_path):
    # Same weights, config.json in the transformers-4 form: same logits.
    for f in d.iterdir():
        shutil.copy(f, tmp_path / f.name)
    shutil.copy(d / "config_t4.json", tmp_path / "config.json")
    ids, ref, tol = _reference(d)
    model = load_model(tmp_path).model
    r = compare(sequence_logits(model, ids, decode_from=len(ids) // 2), ref, tol)
    assert r["ok"], r
