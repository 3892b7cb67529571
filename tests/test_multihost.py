"""Two hosts over real ssh: OpenSSH servers started here, one per "host".

Each host is an sshd (Debian's openssh-server; fetched with `apt-get download`
and unpacked into a temp dir when the machine has none installed) listening on
its own loopback address (127.0.0.2, 127.0.0.3) in its own UTS namespace, so
the ranks it starts see their own host name (mlx-a, mlx-b). A throwaway
ed25519 key logs in; an ssh wrapper first in PATH points the real OpenSSH
client (ours and mpirun's) at a config naming the two hosts. Jobs over ring
and over mpirun with a hostfile must reproduce single-process logits.
Each sshd also runs in its own mount namespace: on mlx-b an empty directory
hides the copy of the model at `model` (that host has no checkpoint), and
each host's `cache` is a directory of its own (the shard cache, issue 43).
Everything is torn down afterwards (sshd processes, the privilege-separation
user and directory if this test made them).

Needs root on Linux (sshd's privilege separation) and the ssh client.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.cluster.launcher import find_mpirun
from mlxcel_dist.checkpoint.loader import load_model

from reference_cases import FIXTURES, FP32_REL_TOL, compare
from testproc import run_cmd

HOSTS = {"mlx-a": "127.0.0.2", "mlx-b": "127.0.0.3"}
CASE = FIXTURES / "gemma3" / "gqa_fp32"
CLI = [sys.executable, "-m", "mlxcel_dist.cli"]

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0,
                       reason="starts sshd, which needs root on Linux"),
    pytest.mark.skipif(shutil.which("ssh") is None or shutil.which("ssh-keygen") is None,
                       reason="needs the OpenSSH client"),
]


def _sshd_binary(workdir: Path) -> tuple[str, dict]:
    """An sshd to run and the environment it needs."""
    installed = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
    if installed:
        return installed, {}
    debs = workdir / "debs"
    debs.mkdir()
    p = subprocess.run(["apt-get", "download", "openssh-server", "libwrap0"], cwd=debs,
                       capture_output=True, text=True, timeout=180)
    found = glob.glob(str(debs / "openssh-server_*.deb"))
    if p.returncode != 0 or not found:
        pytest.skip(f"no sshd installed and apt-get download failed: {p.stderr.strip()[-200:]}")
    root = workdir / "root"
    for deb in glob.glob(str(debs / "*.deb")):
        subprocess.run(["dpkg", "-x", deb, str(root)], check=True, timeout=60)
    libdirs = [str(d) for d in (root / "usr/lib/x86_64-linux-gnu", root / "lib/x86_64-linux-gnu",
                                root / "usr/lib/aarch64-linux-gnu", root / "lib/aarch64-linux-gnu") if d.is_dir()]
    return str(root / "usr/sbin/sshd"), {"LD_LIBRARY_PATH": ":".join(libdirs)}


def _wait_port(ip: str, port: int, proc, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited: {log.read_text()[-500:]}")
        try:
            with socket.create_connection((ip, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd on {ip}:{port} never listened: {log.read_text()[-500:]}")


@pytest.fixture(scope="module")
def ssh_hosts():
    work = Path(tempfile.mkdtemp(prefix="mlxcel-ssh-"))
    made_user = made_dir = False
    procs = []
    saved_path = os.environ.get("PATH", "")
    try:
        sshd, sshd_env = _sshd_binary(work)
        try:
            pwd.getpwnam("sshd")
        except KeyError:  # privilege separation user, as openssh-server's postinst makes it
            subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/run/sshd",
                            "--shell", "/usr/sbin/nologin", "sshd"], check=True, timeout=30)
            made_user = True
        if not os.path.isdir("/run/sshd"):
            os.makedirs("/run/sshd", mode=0o755)
            made_dir = True
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / key)],
                           check=True, timeout=30)
        shutil.copy(work / "client_key.pub", work / "authorized_keys")
        (work / "sshd_config").write_text(
            f"HostKey {work / 'host_key'}\nAuthorizedKeysFile {work / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\n"
        )
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
        s.close()
        client = [f"Host {name}\n  HostName {ip}\n  Port {port}\n" for name, ip in HOSTS.items()]
        client.append(f"Host mlx-*\n  User root\n  IdentityFile {work / 'client_key'}\n"
                      "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
        (work / "ssh_config").write_text("".join(client))
        shutil.copytree(CASE, work / "model")
        for d in ("empty", "cache", "cache-mlx-a", "cache-mlx-b"):
            (work / d).mkdir()
        for name, ip in HOSTS.items():
            log = work / f"sshd-{name}.log"
            # its own UTS namespace: what runs there sees host name `name`; its own mounts: its own
            # shard cache at work/cache, and on mlx-b no model at work/model
            mounts = f"mount --bind {work / f'cache-{name}'} {work / 'cache'}"
            if name == "mlx-b":
                mounts += f" && mount --bind {work / 'empty'} {work / 'model'}"
            cmd = ["unshare", "--uts", "--mount", "sh", "-c", f'hostname {name} && {mounts} && exec "$@"', "sh",
                   sshd, "-D", "-e", "-f", str(work / "sshd_config"), "-o", f"ListenAddress={ip}", "-p", str(port)]
            procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=dict(os.environ, **sshd_env)))
            _wait_port(ip, port, procs[-1], log)
        bindir = work / "bin"
        bindir.mkdir()
        wrapper = bindir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {work / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        os.environ["PATH"] = f"{bindir}{os.pathsep}{saved_path}"
        hostfile = work / "hosts"
        hostfile.write_text("".join(f"{name} slots=1\n" for name in HOSTS))
        yield {"hostfile": hostfile, "logs": [work / f"sshd-{n}.log" for n in HOSTS], "work": work,
               "model": work / "model", "cache": work / "cache"}
    finally:
        os.environ["PATH"] = saved_path
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if made_user:
            subprocess.run(["userdel", "sshd"], timeout=30)
        if made_dir:
            shutil.rmtree("/run/sshd", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _single_process_logits(ids):
    return sequence_logits(load_model(CASE).model, ids)


@pytest.mark.parametrize("backend", ["ring", pytest.param("mpi", marks=pytest.mark.skipif(
    find_mpirun() is None, reason="no mpirun"))])
def test_two_hosts_over_ssh_match_single_process(ssh_hosts, tmp_path, backend):
    ids = np.load(CASE / "reference.npz")["ids"]
    np.save(tmp_path / "ids.npy", ids)
    before = [log.read_text().count("Accepted publickey") for log in ssh_hosts["logs"]]
    p = run_cmd([*CLI, "logits", str(CASE), "--tokens-file", str(tmp_path / "ids.npy"),
                 "--out", str(tmp_path / "out.npy"), "--np", "2", "--hostfile", str(ssh_hosts["hostfile"]),
                 "--backend", backend], timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(np 2)" in p.stdout + p.stderr  # over ssh -tt rank 0's stderr arrives on its tty
    after = [log.read_text().count("Accepted publickey") for log in ssh_hosts["logs"]]
    # every host was logged into (a reachability probe, then its rank or mpirun's daemon)
    assert all(a > b for a, b in zip(after, before)), (before, after)
    r = compare(np.load(tmp_path / "out.npy"), _single_process_logits(ids), FP32_REL_TOL)
    assert r["ok"], r


def _launch_helper(ssh_hosts, tmp_path, helper: str, argv: list) -> str:
    """Run tests/helpers/<helper> on the two hosts over ring (launcher.launch
    with the hostfile); its output, asserting exit 0."""
    path = Path(__file__).parent / "helpers" / helper
    code = ("import sys; from mlxcel_dist.cluster.launcher import launch; "
            f"sys.exit(launch({argv!r}, 2, 'ring', hostfile={str(ssh_hosts['hostfile'])!r}, "
            f"script={str(path)!r}))")
    p = run_cmd([sys.executable, "-c", code], timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    return (p.stdout + p.stderr).replace("\r", "")


def test_ranks_see_their_own_host(ssh_hosts, tmp_path):
    # the allsum helper prints its host name; rank 1's line comes prefixed
    text = _launch_helper(ssh_hosts, tmp_path, "allsum_rank.py", ["--print-host"])
    assert "host=mlx-a" in text and "host=mlx-b" in text, text


def test_host_channel_between_two_hosts(ssh_hosts, tmp_path):
    # serve's step channel (collectives.HostChannel) between ranks started over ssh:
    # rank 0 advertises its addresses, rank 1 connects; 30 exchanges equal the device gather
    text = _launch_helper(ssh_hosts, tmp_path, "channel_rank.py", ["--steps", "30"])
    assert "channel ok ranks=2 steps=30" in text, text


@pytest.mark.parametrize("split", [["--np", "2"], ["--np", "2", "--pp", "2"]], ids=["np2", "pp2"])
def test_second_host_without_the_model_gets_its_shard(ssh_hosts, tmp_path, split):
    # mlx-b has no copy of the model: the launcher (which has it) sends rank 1 its shard's pieces, the
    # small files, nothing more; a second launch sends nothing; the logits are those of a launch with
    # the model on both hosts (CASE is visible to both), bit for bit
    import re

    from mlxcel_dist.checkpoint import shardcache
    from mlxcel_dist.checkpoint.loader import open_model

    ids = np.load(CASE / "reference.npz")["ids"]
    np.save(tmp_path / "ids.npy", ids)
    model = ssh_hosts["model"]
    common = ["--tokens-file", str(tmp_path / "ids.npy"), *split, "--hostfile", str(ssh_hosts["hostfile"]),
              "--backend", "ring"]

    def run(model_dir, out, *extra):
        p = run_cmd([*CLI, "logits", str(model_dir), *common, "--out", str(tmp_path / out), *extra],
                    timeout=240, cwd=tmp_path)
        assert p.returncode == 0, p.stdout + p.stderr
        return (p.stdout + p.stderr).replace("\r", "")

    pp = 2 if "--pp" in split else 1
    shard = sum(p.nbytes for p in shardcache.rank_pieces(open_model(model), 2, 1, pp))
    files = sum((model / n).stat().st_size for n in shardcache.small_files(model))
    cache = str(ssh_hosts["cache"] / f"pp{pp}")  # on each host its own directory (its mount)
    first = run(model, "first.npy", "--shard-cache", cache)
    assert "fetch mlx-a: holds MODEL at the same revision, sent nothing" in first, first
    m = re.search(r"fetch mlx-b: sent \S+ \S+ \((\d+) bytes;", first)
    assert m and int(m.group(1)) == shard + files, (first, shard, files)
    assert "no copy of MODEL on the host" in first
    assert not list((ssh_hosts["work"] / "cache-mlx-a").glob("**/shards.json"))  # mlx-a read its own copy
    assert len(list((ssh_hosts["work"] / "cache-mlx-b").glob(f"pp{pp}/*/*/shards.json"))) == 1
    second = run(model, "second.npy", "--shard-cache", cache)
    assert "fetch mlx-b: sent 0 B (0 bytes;" in second, second
    run(CASE, "both.npy", "--no-fetch")
    a, b, c = (np.load(tmp_path / f"{x}.npy") for x in ("first", "second", "both"))
    assert np.array_equal(a, c) and np.array_equal(b, c)
