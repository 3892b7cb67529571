"""Faults for real: a rank SIGKILLed or SIGSTOPped at load, prefill or decode
of a real `generate` job, on ring and MPI; the launcher itself killed; a long
legitimate computation that must not look like a stall. Every job must end
non-zero naming the rank, in time, and leave no process behind."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxcel_dist.cluster.launcher import find_mpirun, launch
from testproc import alive, descendants, run_cmd

ROOT = Path(__file__).resolve().parent.parent
HELPER = str(ROOT / "tests" / "helpers" / "allsum_rank.py")
BACKENDS = ["ring", pytest.param("mpi", marks=pytest.mark.skipif(find_mpirun() is None, reason="no mpirun"))]
CLI = [sys.executable, "-m", "mlxcel_dist.cli"]
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find leftovers")


def _generate_with_fault(tmp_path, fault, backend, *extra):
    stamp = tmp_path / "fault_time"
    env = dict(os.environ, MLXCEL_DIST_INJECT_FAULT=fault, MLXCEL_DIST_INJECT_FAULT_STAMP=str(stamp))
    p = run_cmd([*CLI, "generate", "--np", "2", "--backend", backend, "-n", "24", *extra],
                env=env, timeout=120, cwd=tmp_path)
    ended = time.time()
    assert stamp.exists(), f"the fault never fired\n{p.stdout}\n{p.stderr}"
    return p, ended - float(stamp.read_text())


@pytest.mark.parametrize("phase", ["load", "prefill", "decode"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_rank_ends_the_job_within_5s(tmp_path, backend, phase):
    p, reaction = _generate_with_fault(tmp_path, f"kill:1:{phase}", backend)
    assert p.returncode == 128 + signal.SIGKILL, p.stderr
    assert re.search(r"mlxcel-dist: rank 1 was killed by SIGKILL", p.stderr), p.stderr
    assert "Traceback" not in p.stderr
    assert reaction < 5, f"{reaction:.1f} s from the kill to the launcher's exit"
    assert descendants() == []


@pytest.mark.parametrize("phase", ["load", "decode"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_stopped_rank_ends_the_job_within_stall_timeout(tmp_path, backend, phase):
    p, reaction = _generate_with_fault(tmp_path, f"stop:1:{phase}", backend, "--stall-timeout", "4")
    assert p.returncode == 124, p.stderr
    assert "mlxcel-dist: rank 1 stopped making progress: no heartbeat" in p.stderr, p.stderr
    assert p.stderr.count("mlxcel-dist:") == 1, p.stderr
    assert reaction < 4 + 5, f"{reaction:.1f} s from SIGSTOP to the launcher's exit"
    assert descendants() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_late_to_join_is_not_a_stall(tmp_path, backend):
    """Rank 1 reaches the backend's connect LATE_S after rank 0, whose connect
    holds the GIL (no heartbeats) meanwhile: longer than the stall timeout,
    yet no stall (a loaded box starts ranks unevenly; CI once stopped a job so)."""
    p, _ = _generate_with_fault(tmp_path, "late:1:join", backend, "--stall-timeout", "3")
    assert p.returncode == 0, p.stderr
    assert "stopped making progress" not in p.stderr
    assert p.stdout.strip()  # the text, generated after the late join


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_computation_is_not_a_stall(capfd, backend):
    # every rank computes (GIL released inside MLX) for twice the stall timeout
    rc = launch(["--busy", "8"], 2, backend, script=HELPER, stall_timeout=4)
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "allsum ok rank=0" in out and "stopped making progress" not in err


@pytest.mark.parametrize("backend", BACKENDS)
def test_launcher_killed_leaves_no_rank_behind(backend):
    code = ("import sys; from mlxcel_dist.cluster.launcher import launch; "
            f"sys.exit(launch(['--sleep', '120'], 2, {backend!r}, script={HELPER!r}))")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = p.stdout.readline()  # rank 0 is past its all_sum: every rank is up
    assert line.startswith(b"allsum ok rank=0"), line
    ranks = descendants(p.pid)
    assert len(ranks) >= 2
    p.kill()  # SIGKILL: the launcher gets no chance to clean up
    p.wait(timeout=10)
    deadline = time.monotonic() + 5
    while alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive(ranks)
    assert left == [], f"ranks still running 5 s after the launcher died: {left}"


def test_bad_stall_timeout_is_one_line(tmp_path):
    p = run_cmd([*CLI, "generate", "--np", "2", "--stall-timeout", "1"], timeout=60, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and "3 heartbeats" in p.stderr


@pytest.mark.parametrize("fault, words", [
    ("version:1", "ranks run different versions: rank(s) 0 ("),
    ("nomodel:1", "the embedded default model not found on rank 1 ("),
])
def test_cluster_check_before_loading(tmp_path, fault, words):
    # one rank reports another mlx version / no model: one error line from
    # rank 0, exit 2, before any weights are read
    env = dict(os.environ, MLXCEL_DIST_INJECT_FAULT=fault)
    p = run_cmd([*CLI, "generate", "--np", "2", "-n", "4"], env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: " + words), p.stderr
    assert p.stderr.count("\n") == 1 and p.stdout == "", p.stderr
    assert descendants() == []


def test_cluster_check_sees_models_as_the_loader_does(tmp_path, monkeypatch):
    # the same MODEL strings count as present on a rank as the loader accepts
    from mlxcel_dist.checkpoint.loader import model_present

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    assert model_present("~/ckpt") and model_present(str(tmp_path / "ckpt"))
    assert model_present("owner/name") and model_present(None)  # a Hub id: each host downloads it
    for missing in ("~/nope", "./nope", "/nope/x", "a/b/c", "owner/"):
        assert not model_present(missing), missing
