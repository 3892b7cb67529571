"""Nothing listens beyond loopback on one machine, nothing but the job talks
to the launcher, and nothing from a checkpoint ever runs."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxcel_dist.cli import app
from mlxcel_dist.cluster.launcher import launch
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.cluster.watchdog import HeartbeatMonitor
from testproc import descendants

ROOT = Path(__file__).resolve().parent.parent
HELPER = str(ROOT / "tests" / "helpers" / "allsum_rank.py")


def _listening(pids):
    """(ip, port) of every TCP socket in LISTEN state and every bound UDP
    socket that one of ``pids`` holds (Linux /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, listen_only in (("tcp", True), ("tcp6", True), ("udp", False), ("udp6", False)):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[9] in inodes and (not listen_only or f[3] == "0A"):
                ip_hex, port_hex = f[1].split(":")
                ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(ip_hex)[::-1]) if len(ip_hex) == 8 else ip_hex
                found.add((ip, int(port_hex, 16)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_single_node_ring_job_listens_on_loopback_only(capfd):
    seen, ranks_seen = set(), set()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "rc", launch(["--sleep", "4"], 2, "ring", script=HELPER)))
    t.start()
    deadline = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < deadline:
        ranks = _listening(descendants())
        ranks_seen |= ranks
        seen |= ranks | _listening([os.getpid()])  # the launcher's own (heartbeat) socket too
        time.sleep(0.2)
    t.join()
    assert result["rc"] == 0, capfd.readouterr().err
    assert ranks_seen, "found no socket of the ranks to check"
    assert all(ip == "127.0.0.1" for ip, _ in seen), seen


def test_heartbeats_without_the_job_token_are_ignored():
    mon = HeartbeatMonitor("127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"0" * 32 + b" 0 1234", ("127.0.0.1", mon.port))  # wrong token
            s.sendto(b"garbage", ("127.0.0.1", mon.port))
            s.sendto(f"{mon.token} 1 4321".encode(), ("127.0.0.1", mon.port))
        deadline = time.monotonic() + 5
        while 1 not in mon.last and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mon.pids == {1: 4321}
    finally:
        mon.close()


def test_checkpoint_code_never_runs(tmp_path):
    # transformers would import modeling_*.py / tokenization_*.py named by
    # auto_map with trust_remote_code; we never import anything from a checkpoint
    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d)
    marker = tmp_path / "pwned"
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py", "__init__.py"):
        (d / name).write_text(payload)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                       "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (d / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    tcfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    r = CliRunner().invoke(app, ["generate", str(d), "-n", "3"])
    assert r.exit_code == 0, r.output
    load_model(d)
    assert not marker.exists()


def test_pickle_weights_are_never_loaded(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(default_model_dir(), d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle
    r = CliRunner().invoke(app, ["info", str(d)])
    assert r.exit_code == 2
    assert "only pickle weights (.bin/.pt) found; mlxcel-dist reads safetensors only" in r.output


def _own_non_loopback_ip():
    # The address this host would send from (a UDP connect sends nothing).
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never reached
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def test_serve_defaults_to_loopback(tmp_path):
    # `serve` without --host, run as a user runs it: the HTTP socket it opens
    # is bound to 127.0.0.1 only, and this host's other address refuses it.
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxcel_dist.cli", "serve", "--port", "0"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, m = time.monotonic() + 90, None
        while m is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            m = re.search(r"^serve: .* on http://(\S+):(\d+)/v1", log.read_text(), re.M)
        assert m, f"serve did not come up (rc {proc.poll()}):\n{log.read_text()}"
        host, port = m.group(1), int(m.group(2))
        assert host == "127.0.0.1", log.read_text()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert r.status == 200
        if Path("/proc/net/tcp").exists():
            bound = _listening([proc.pid, *descendants(proc.pid)])
            assert ("127.0.0.1", port) in bound and all(ip == "127.0.0.1" for ip, _ in bound), bound
        other = _own_non_loopback_ip()
        if other is not None:
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=5).close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
                proc.wait(timeout=10)
