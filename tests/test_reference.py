"""Per-family runner: every fixture, every feeding mode, against transformers."""

import shutil

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.checkpoint.loader import load_model

from reference_cases import (BF16_REL_TOL, FP32_REL_TOL, case_id, cases, compare, mode_logits, modes,
                             single_process_logits, window_of)

CASES = cases()


def _reference(d):
    ref = np.load(d / "reference.npz")
    bf16 = "logits_fp32" in ref
    return ref["ids"], ref["logits"], BF16_REL_TOL if bf16 else FP32_REL_TOL


@pytest.fixture(scope="module", params=CASES, ids=[case_id(d) for d in CASES])
def case(request):
    return request.param


def test_fixtures_exist():
    assert len(CASES) >= 5


@pytest.mark.parametrize("mode", list(modes(16, 64)))
def test_matches_reference(case, mode):
    # the session's single-process logits (reference_cases.mode_logits): test_tp
    # and test_pipeline compare their launched runs with the same ones
    d = case
    ids, ref, tol = _reference(d)
    kw = modes(window_of(d), len(ids))[mode]
    r = compare(mode_logits(d, tuple(sorted(kw.items()))), ref, tol)
    assert r["ok"], r


def test_session_logits_are_the_harness_logits():
    # reference_cases.single_process_logits mirrors harness.all_mode_logits
    # (through a cache): same modes, same arrays
    from mlxcel_dist.harness import all_mode_logits

    d = CASES[0]
    want = all_mode_logits(load_model(d).model, np.load(d / "reference.npz")["ids"])
    got = single_process_logits(d)
    assert set(got) == set(want)
    for mode in want:
        np.testing.assert_array_equal(got[mode], want[mode])


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
    for kw in modes(window_of(d), len(ids)).values():
        ours = np.abs(mode_logits(d, tuple(sorted(kw.items()))) - exact).max() / scale
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
