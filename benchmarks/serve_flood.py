"""Hostile load against a running `mlxcel-dist serve`: idle connections
that never send a byte, plus a flood of bad requests of many kinds, while a
normal client keeps asking. Prints (or writes as JSON) what it measured:
the status of every hostile request by kind, the normal completions' and
/health's latency during the flood, and whether the server still answers
after it.

    mlxcel-dist serve --port 8080 --np 2 2> serve.log &
    python benchmarks/serve_flood.py --port 8080 --idle 5000 --hostile 2000
    grep -c Traceback serve.log   # 0: one line per rejected request

Only loopback: the target is 127.0.0.1 (or --host, which must be loopback).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ipaddress
import json
import resource
import socket
import statistics
import threading
import time

DEEP = b'{"prompt": "x", "a": ' + b"[" * 20000 + b"]" * 20000 + b"}"
DIGITS = b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"


def _post(path: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: " + content_type
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


# name -> raw bytes sent (each on its own connection)
HOSTILE = {
    "top_k_int32_overflow": _post("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],'
                                  b'"max_tokens":2,"top_k":2147483648}'),
    "top_k_1e30": _post("/v1/completions", b'{"prompt":"hi","max_tokens":2,"top_k":1e30}'),
    "deep_json": _post("/v1/completions", DEEP),
    "5000_digits": _post("/v1/completions", DIGITS),
    "nan": _post("/v1/completions", b'{"prompt":"x","temperature":NaN}'),
    "bad_utf8": _post("/v1/completions", b'{"prompt":"caf\xe9"}'),
    "malformed": _post("/v1/completions", b"{not json"),
    "not_object": _post("/v1/completions", b"[1,2,3]"),
    "unknown_model": _post("/v1/completions", b'{"model":"gpt-9","prompt":"x"}'),
    "max_tokens_0": _post("/v1/completions", b'{"prompt":"x","max_tokens":0}'),
    "temperature_5": _post("/v1/completions", b'{"prompt":"x","temperature":5}'),
    "bad_role": _post("/v1/chat/completions", b'{"messages":[{"role":"wizard","content":"x"}]}'),
    "vocab": _post("/v1/completions", b'{"prompt":[99999999]}'),
    "oversized": _post("/v1/completions", b'{"prompt":"' + b"a" * 1_100_000 + b'"}'),
    "not_http": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n",
    "bad_header": b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    "unknown_path": _post("/v1/nothing", b"{}"),
    "half_body": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"prompt"'),
}
GOOD = json.dumps({"prompt": "The sea", "max_tokens": 8, "temperature": 0}).encode()


def _send(host: str, port: int, data: bytes, half_close: bool, timeout: float = 60) -> str:
    """The status line's code ("-" when the server closed without one)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)  # a client that leaves mid-body
            got = b""
            while b"\r\n" not in got:
                part = s.recv(4096)
                if not part:
                    break
                got += part
        except OSError:
            return "reset"
    return got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "-"


def _timed(host: str, port: int, data: bytes) -> tuple[str, float]:
    t = time.monotonic()
    code = _send(host, port, data, False)
    return code, time.monotonic() - t


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))


def flood(host: str, port: int, idle: int, hostile: int, workers: int = 32) -> dict:
    if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        raise SystemExit("serve_flood targets loopback only")
    _raise_fd_limit(idle + 4 * workers + 256)
    t0 = time.monotonic()
    idlers = []
    for _ in range(idle):  # connections that never send anything
        idlers.append(socket.create_connection((host, port), timeout=30))
    opened_s = time.monotonic() - t0
    probes = {"health": [], "completion": []}
    stop = threading.Event()

    def prober():
        while not stop.is_set():
            for name, data in (("health", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
                               ("completion", _post("/v1/completions", GOOD))):
                probes[name].append(_timed(host, port, data))
            time.sleep(0.05)

    th = threading.Thread(target=prober, daemon=True)
    th.start()
    kinds = list(HOSTILE)
    codes: dict = {k: {} for k in kinds}
    t1 = time.monotonic()
    with cf.ThreadPoolExecutor(workers) as pool:
        futs = {pool.submit(_send, host, port, HOSTILE[kinds[i % len(kinds)]], kinds[i % len(kinds)] == "half_body"):
                kinds[i % len(kinds)] for i in range(hostile)}
        for f in cf.as_completed(futs):
            k = futs[f]
            try:
                c = f.result()
            except OSError as e:
                c = type(e).__name__
            codes[k][c] = codes[k].get(c, 0) + 1
    flood_s = time.monotonic() - t1
    stop.set()
    th.join()
    after = {name: _timed(host, port, data) for name, data in (
        ("health", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"), ("completion", _post("/v1/completions", GOOD)))}
    still_open = 0
    for s in idlers:
        s.setblocking(False)
        try:
            still_open += s.recv(1) == b"" and 0 or 1
        except BlockingIOError:
            still_open += 1
        except OSError:
            pass
        s.close()

    def summary(xs):
        secs = [t for _, t in xs]
        return {"n": len(xs), "codes": sorted({c for c, _ in xs}), "median_s": round(statistics.median(secs), 4),
                "max_s": round(max(secs), 4)} if xs else {}

    return {"idle_connections": idle, "opened_s": round(opened_s, 2), "hostile": hostile,
            "flood_s": round(flood_s, 2), "codes": codes,
            "during": {k: summary(v) for k, v in probes.items()},
            "after": {k: {"code": c, "s": round(t, 4)} for k, (c, t) in after.items()},
            "idle_still_open_at_end": still_open}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--idle", type=int, default=5000)
    ap.add_argument("--hostile", type=int, default=2000)
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args()
    out = flood(a.host, a.port, a.idle, a.hostile)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
