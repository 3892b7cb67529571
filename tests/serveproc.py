"""A `mlxcel-dist serve` job in a subprocess for tests, on a free loopback
port, with its log kept for the test to read."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testproc import alive, descendants

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "mlxcel_dist.cli"]
READY_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, np_, tmp, extra=(), backend="mpi", env=None):
        self.port = _free_port()
        self.np = np_
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"serve-np{np_}.log", "w+")
        args = [*CLI, "serve", str(model_dir), "--port", str(self.port), "--np", str(np_), *extra]
        if np_ > 1:
            args += ["--backend", backend]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=None if env is None else {**os.environ, **env})
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def _wait_ready(self):
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.base + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        pytest.fail(f"server not ready after {READY_S}s:\n{self.output()}")

    def stop(self) -> int | None:
        family = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                # every process's Python stacks into the log (cli._stack_dumps), shown with the failure
                for pid in [self.proc.pid, *alive(descendants(self.proc.pid))]:
                    try:
                        os.kill(pid, signal.SIGUSR1)
                    except OSError:
                        pass
                time.sleep(2)
                print(f"the server did not stop within 20 s of SIGTERM; its log:\n{self.output()[-12000:]}")
                os.killpg(self.proc.pid, signal.SIGKILL)  # the session we started
                self.proc.wait(timeout=10)
        self.log.close()
        deadline = time.monotonic() + 10
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(family)
        if left:  # the launcher must not leave ranks behind
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"processes left after the server stopped: {left}")
        return self.proc.returncode

    # -- requests -------------------------------------------------------------
    def post(self, path, body, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", ""), e.read()

    def json(self, path, body):
        status, _, data = self.post(path, body)
        assert status == 200, data
        return json.loads(data)

    def stream(self, path, body):
        status, ctype, data = self.post(path, {**body, "stream": True})
        assert status == 200, data
        assert ctype.startswith("text/event-stream")
        events = [e for e in data.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), events
        assert events[-1] == "data: [DONE]"
        return [json.loads(e[len("data: "):]) for e in events[:-1]]


def rank_pid(family, rank) -> int:
    for pid in family:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (f"MLX_RANK={rank}".encode() in env or f"OMPI_COMM_WORLD_RANK={rank}".encode() in env) \
                and b"_rank_main" in cmd:
            return pid
    raise AssertionError(f"rank {rank} not found among {family}")


def kill_rank_during(s: Server, threads, started, victim: int):
    """Start the client `threads`, wait until each has released `started`
    (its stream runs, or is already over), SIGKILL rank `victim` of the
    server's job, wait for the clients (none may hang) and for the launcher:
    (launcher rc, the server's output, the kill's monotonic time)."""
    try:
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120), s.output()
        family = descendants(s.proc.pid)
        t0 = time.monotonic()
        os.kill(rank_pid(family, victim), signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        rc = s.proc.wait(timeout=60)
    finally:
        out = s.output()
        s.stop()
    return rc, out, t0
