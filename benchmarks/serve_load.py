"""Load test of OpenAI-compatible servers: `mlxcel-dist serve` (np 1, np 2)
against `mlx_lm.server` (np 1, and np 2 under `mlx.launch --backend ring`)
on one checkpoint.

    python benchmarks/serve_load.py                      # 1 and 8 clients x 2 requests x 64 tokens
    python benchmarks/serve_load.py --clients 1,4,16 --requests 3 --json out.json
    python benchmarks/serve_load.py --servers ours-np1,mlx_lm-np1
    python benchmarks/serve_load.py --servers ours-np1,ours-pp2       # pipeline stages against one rank
    python benchmarks/serve_load.py --servers ours-np1,ours-np1@../old-checkout   # this code vs another commit's
    python benchmarks/serve_load.py --servers ours-np1 --formats text,json_schema   # constrained decoding's cost
    python benchmarks/serve_load.py --servers ours-np1,ours-np2 --clients 8 --requests 4 \
        --formats text,json_schema,text,json_schema,text,json_schema   # its ratio at 8 clients, paired rounds
    python benchmarks/serve_load.py --model TARGET --servers ours-np1,ours-np1-draft,ours-np1-lookup \
        --text repeat --ignore-eos            # drafts in serve (TARGET: benchmarks/spec_pair.py's)

Without --model it writes a random-weight bf16 llama of ~25M parameters
(hidden 512, 8 layers, 8 q / 4 KV heads of 64, MLP 1536) with the embedded
model's tokenizer (512 tokens) under $MLXCEL_BENCH_CACHE or the system temp
dir (reused; never committed).

Per server: start it, wait until /v1/models answers, warm up (every client
count's batch once, 8 tokens: graphs for each batch size get built), then for
each client count N: N threads, each sending M streaming greedy
/v1/completions requests one after another (distinct short prompts, 64
tokens, `stream_options.include_usage`); aggregate tok/s = completion tokens
of all requests / wall time of the round; TTFT = first text chunk; latency =
the whole request; a connection reset before any answer (mlx_lm.server's
listen backlog of 5 overflows at 16 clients) is retried and counted, its wait
included. `--formats`: each round once per response_format (text: none;
json_schema: FORMATS' schema, a list of at least 40 small objects, so every
answer runs its 64 tokens under the grammar; json_object), on the same
server one after another; the last lines give each constrained format's
tok/s over text's, mean and round by round. Servers run one after another
(never two at once); `loadavg` is printed before each so that a loaded
machine shows. `-draft` / `-lookup`
servers verify drafts (`--draft-model`, default the embedded gemma3-tiny, the
spec pair's draft; `--prompt-lookup`), K = `--num-draft-tokens`; `--text
repeat` sends benchmarks/spec_decode.py's repeated passage (each request its
own first line), `--ignore-eos` makes every answer run its tokens; the
drafted servers' acceptance (/metrics) is printed with their rows; a server
without /metrics (mlx_lm.server answers 404) gets one line saying so and no
acceptance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
BIN_LM = Path(os.environ.get("MLX_LM_BIN", BIN))  # mlx_lm.server / mlx.launch from another venv (mlx-lm needs transformers)

LLAMA_24M = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, vocab_size=512)


def llama_checkpoint(seed: int = 0) -> Path:
    import mlx.core as mx

    c = LLAMA_24M
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **c, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1, "hidden_act": "silu"}
    base = os.environ.get("MLXCEL_BENCH_CACHE") or os.path.join(tempfile.gettempdir(), "mlxcel-bench")
    out = Path(base) / f"llama-serve-load-s{seed}"
    if (out / "model.safetensors").exists() and json.loads((out / "config.json").read_text()) == config:
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, i, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,), "lm_head.weight": (V, h)}
    for n in range(L):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    key = mx.random.key(seed)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = mx.ones(shape, dtype=mx.bfloat16)
        else:
            key, sub = mx.random.split(key)
            weights[name] = (mx.random.normal(shape, key=sub) * 0.02).astype(mx.bfloat16)
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "gemma3-tiny" / f, out / f)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {out} ({sum(math.prod(s) for s in shapes.values()) / 1e6:.1f}M parameters)", file=sys.stderr)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(name: str, model: Path, port: int, backend: str | None = None, draft: Path | None = None,
               k: int = 3) -> list[str]:
    ours = [sys.executable, "-m", "mlxcel_dist.cli", "serve", str(model), "--port", str(port)]
    drafts = ["--draft-model", str(draft or ROOT / "models" / "gemma3-tiny"), "--num-draft-tokens", str(k)]
    lookup = ["--prompt-lookup", "--num-draft-tokens", str(k)]
    multi = ["--backend", backend] if backend else []  # for our multi-rank servers
    # `python -m mlx_lm.server` where the console script is not installed (a PYTHONPATH-only setup)
    script = BIN_LM / "mlx_lm.server"
    mlx_lm = ([str(script)] if script.exists() else [sys.executable, "-m", "mlx_lm.server"]) + [
        "--model", str(model), "--port", str(port)]
    return {
        "ours-np1": ours,
        "ours-np2": ours + ["--np", "2", *multi],
        "ours-np1-draft": ours + drafts,
        "ours-np2-draft": ours + ["--np", "2", *multi, *drafts],
        "ours-np1-lookup": ours + lookup,
        "ours-np2-lookup": ours + ["--np", "2", *multi, *lookup],
        "ours-pp2": ours + ["--pp", "2", *multi],  # two pipeline stages, whole steps
        "ours-pp2-micro2": ours + ["--pp", "2", "--micro-batches", "2", *multi],
        # --warmup is off by default since d611b81 (these names are the runs of docs/benchmarks-log.md before it)
        "ours-np1-nowarmup": ours + ["--no-warmup"],
        "ours-np2-nowarmup": ours + ["--np", "2", "--no-warmup"],
        "ours-np1-warmup": ours + ["--warmup"],
        "ours-np2-warmup": ours + ["--np", "2", "--warmup"],
        "mlx_lm-np1": mlx_lm,
        "mlx_lm-np2": [str(BIN_LM / "mlx.launch"), "--backend", "ring", "-n", "2", *mlx_lm],
    }[name]


RETRIES = []  # connections reset before any answer (a full listen backlog), retried


def _open(req, attempts: int = 20):
    for i in range(attempts):
        try:
            return urllib.request.urlopen(req, timeout=600)
        except ConnectionResetError:
            if i == attempts - 1:
                raise
            RETRIES.append(1)
            time.sleep(0.05 * (i + 1))


def post_stream(base: str, body: dict, on_text=None) -> tuple[int, float, float]:
    """(completion tokens, ttft s, latency s) of one streaming request;
    `on_text(t)` at each text chunk's arrival (perf_counter; with logprobs
    asked, at each chunk carrying a token, its text held back or not)."""
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    with _open(req) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            for c in d.get("choices") or []:
                if c.get("text") or (c.get("logprobs") or {}).get("tokens"):
                    chunks += 1
                    if on_text is not None:
                        on_text(time.perf_counter())
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    return (chunks if tokens is None else tokens), (ttft or 0.0), time.perf_counter() - t0


ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                         "kind": {"enum": ["sea", "sky", "city"]},
                                         "name": {"type": "string", "maxLength": 8}},
        "required": ["id", "kind", "name"], "additionalProperties": False}
FORMATS = {"text": None, "json_object": {"type": "json_object"},
           "json_schema": {"type": "json_schema", "json_schema": {"name": "items", "strict": True, "schema": {
               "type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 40}},
               "required": ["items"], "additionalProperties": False}}}}


TEXT = {"free": "the"}  # --text: what each prompt continues ("repeat": set from spec_decode.py in main)
EXTRA = {}  # every request's extra fields (--ignore-eos)


def run_round(base: str, clients: int, requests: int, tokens: int, tag: str, fmt: str = "text") -> dict:
    results, errors = [], []
    extra = {**EXTRA, **({"response_format": FORMATS[fmt]} if FORMATS[fmt] else {})}

    def client(c):
        for r in range(requests):
            try:
                results.append(post_stream(base, {"prompt": f"{tag} client {c} request {r}: {TEXT['text']}",
                                                  "max_tokens": tokens, "temperature": 0, **extra}))
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    toks = sum(r[0] for r in results)
    ttfts = sorted(r[1] for r in results)
    lats = sorted(r[2] for r in results)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]

    retries = len(RETRIES)
    RETRIES.clear()
    return {"clients": clients, "format": fmt, "requests": len(results), "tokens": toks, "wall_s": wall, "tok_s": toks / wall,
            "connect_retries": retries,
            "ttft_p50": statistics.median(ttfts), "ttft_p95": pct(ttfts, 0.95),
            "lat_p50": statistics.median(lats), "lat_p95": pct(lats, 0.95)}


def _family_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of `root` and every process below it (Linux /proc; 0 elsewhere)."""
    kids, cpu = {}, {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        kids.setdefault(int(f[1]), []).append(int(d.name))
        cpu[int(d.name)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += kids.get(pid, [])
    return total


def spec_counts(base: str) -> dict | None:
    """The server's /metrics spec_decode_* values (empty: none; None: no /metrics at all, as mlx_lm.server)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise
    return {ln.split()[0].split("spec_decode_")[1]: float(ln.split()[1]) for ln in text.splitlines()
            if "spec_decode_" in ln and not ln.startswith("#")}


@contextlib.contextmanager
def started(name: str, model: Path, log_dir: Path, root: Path = ROOT, backend: str | None = None, draft=None,
            k: int = 3, extra: list | None = None):
    """A server (`server_cmd(name, ...)` + `extra` flags) from checkout `root`,
    answering: yields (base URL, process); ends its whole session after."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tag = name if root == ROOT else f"{name}@{root.name}"
    log = open(log_dir / f"{tag}.log", "w+")
    env = None
    if root != ROOT:  # that checkout first, whatever else the path holds (e.g. a staged MLX) after it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(server_cmd(name, model, port, backend, draft, k) + list(extra or []), cwd=root,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"{name} did not start:\n{log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        # mlx.launch can exit on SIGTERM and leave its ranks running (seen:
        # mlx_lm.server np 2 ranks spinning for an hour): end the whole
        # session, and any process still serving this port.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _kill_port_servers(port)
        proc.wait()
        log.close()


def bench_server(name: str, model: Path, clients: list[int], requests: int, tokens: int, log_dir: Path,
                 root: Path = ROOT, backend: str | None = None, formats=("text",), draft=None, k: int = 3) -> list:
    """`root`: the checkout whose code serves (another one's, to compare versions of ours)."""
    tag = name if root == ROOT else f"{name}@{root.name}"
    with started(name, model, log_dir, root, backend, draft, k) as (base, proc):
        for n in sorted(set(clients)):  # warm-up: each batch size once
            for fmt in formats:
                run_round(base, n, 1, 8, "warm-up", fmt)
        rows = []
        metrics = spec_counts(base) is not None
        if not metrics:
            print(f"{tag}: no /metrics (404): no draft acceptance counted", file=sys.stderr, flush=True)
        for n in clients:  # the server's CPU seconds per token: its own cost, less swayed by a busy machine
            for fmt in formats:
                c0, s0 = _family_cpu_s(proc.pid), spec_counts(base) if metrics else {}
                row = run_round(base, n, requests, tokens, "timed", fmt)
                s1 = spec_counts(base) if metrics else {}
                if s1.get("num_drafts_total", 0) > s0.get("num_drafts_total", 0):  # this round's acceptance
                    d = {x: s1[x] - s0.get(x, 0) for x in ("num_drafts_total", "num_draft_tokens_total",
                                                            "num_accepted_tokens_total")}
                    row["accepted_pct"] = round(100 * d["num_accepted_tokens_total"] / d["num_draft_tokens_total"], 1)
                    row["mean_accepted_length"] = round(1 + d["num_accepted_tokens_total"] / d["num_drafts_total"], 2)
                row["server_cpu_ms_per_token"] = round(1000 * (_family_cpu_s(proc.pid) - c0) / max(row["tokens"], 1),
                                                       3)
                rows.append({"server": name, **row})
        return rows


def _kill_port_servers(port: int) -> None:
    """SIGKILL every process whose command line serves `port` (Linux /proc)."""
    me = os.getpid()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"--port" in args and str(port).encode() in args:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def ratios(rows: list) -> list:
    """Per server and client count, each constrained format's tok/s over
    text's: the mean over rounds, and round by round (the i-th of each
    paired, whatever the order: give them ABBA, text,json_schema,json_schema,
    text, where a server may drift), so drift shows."""
    out = []
    for server, clients in dict.fromkeys((r["server"], r["clients"]) for r in rows):
        got = {}
        for r in rows:
            if (r["server"], r["clients"]) == (server, clients):
                got.setdefault(r["format"], []).append(r["tok_s"])
        for fmt, vals in got.items():
            if fmt != "text" and got.get("text"):
                pairs = [b / a for a, b in zip(got["text"], vals)]
                mean = (sum(vals) / len(vals)) / (sum(got["text"]) / len(got["text"]))
                out.append(f"{server:>11} {clients:>3} clients: {fmt} / text {mean:.2f} (rounds "
                           f"{', '.join(f'{x:.2f}' for x in pairs)})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the random bf16 llama, ~25M)")
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--servers", default="mlx_lm-np1,ours-np1,mlx_lm-np2,ours-np2")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--formats", default="text", help=f"comma-separated response formats ({', '.join(FORMATS)})")
    ap.add_argument("--backend", help="our multi-rank servers' --backend (default: the launcher's auto)")
    ap.add_argument("--draft-model", help="the -draft servers' draft (default: models/gemma3-tiny)")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--text", default="free", choices=["free", "repeat"], help="what the prompts continue")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs its --tokens")
    args = ap.parse_args()
    if args.text == "repeat":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from spec_decode import repeat_text

        TEXT["repeat"] = "\n" + repeat_text()
    TEXT["text"] = TEXT[args.text]
    if args.ignore_eos:
        EXTRA["ignore_eos"] = True
    formats = args.formats.split(",")
    model = Path(args.model) if args.model else llama_checkpoint()
    clients = [int(x) for x in args.clients.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="serve-load-"))
    rows = []
    for spec in args.servers.split(","):
        name, _, root = spec.partition("@")  # NAME@DIR: that checkout's code serves (e.g. an older commit's)
        print(f"{spec}: loadavg {open('/proc/loadavg').read().split()[:3]}", file=sys.stderr, flush=True)
        try:
            got = bench_server(name, model, clients, args.requests, args.tokens, log_dir,
                               Path(root).resolve() if root else ROOT, args.backend, formats,
                               args.draft_model and Path(args.draft_model), args.num_draft_tokens)
            for r in got:
                r["server"] = spec
        except RuntimeError as e:
            print(f"{name}: {e}", file=sys.stderr)
            continue
        rows += got
        for r in got:
            print(f"{r['server']:>11} {r['format']:>11} {r['clients']:>3} clients: {r['tok_s']:7.1f} tok/s  TTFT p50 "
                  f"{r['ttft_p50']:.3f}s p95 {r['ttft_p95']:.3f}s  latency p50 {r['lat_p50']:.2f}s "
                  f"p95 {r['lat_p95']:.2f}s  server CPU {r['server_cpu_ms_per_token']:.1f} ms/token  "
                  f"({r['requests']} requests, {r['tokens']} tokens, "
                  f"{r['connect_retries']} connections reset and retried)"
                  + (f"  drafts: {r['accepted_pct']}% accepted, mean accepted length {r['mean_accepted_length']}"
                     if "accepted_pct" in r else ""), flush=True)
    for line in ratios(rows):
        print(line, flush=True)
    print(f"logs: {log_dir}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
