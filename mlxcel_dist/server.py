"""`mlxcel-dist serve`: an OpenAI-compatible HTTP server (standard library only).

Rank 0 runs a ``ThreadingHTTPServer``: handler threads parse and validate each
request, tokenize its prompt (chat template included) and put a job into one
queue. Rank 0's main thread takes jobs one at a time (queued, never dropped)
and hands each to every rank with collectives only (:func:`exchange`), then
all ranks run the same :func:`engine.generate_text`; rank 0 feeds the text to
the waiting handler (all at once, or as SSE chunks with ``stream: true``).
Other ranks loop in :func:`exchange` waiting for the next job; a shutdown
message (sent by rank 0 on SIGINT/SIGTERM) ends them. At np 1 no collective
runs.

The hand-off (:func:`exchange`) is two all_sums in which rank 0 contributes
the data and every other rank zeros (x + 0 = x, exact for integers):

1. a fixed-size int32 header: magic, kind (job/shutdown), prompt length,
   stop-strings byte count, max_tokens, top_k, repetition context size, the
   seed in four 16-bit parts, and the float64 sampling values (temperature,
   top_p, min_p, repetition penalty) bit-copied as int32 pairs, so every rank
   samples with the very same values rank 0 does;
2. an int32 payload: the prompt ids, then the UTF-8 bytes of the stop strings
   (JSON list).
"""

from __future__ import annotations

import json
import math
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from .collectives import SINGLE, Group
from .errors import UserError
from .sampling import SEED_LIMIT, SamplingParams

MAGIC = 0x4D4C5853  # "MLXS"
KIND_JOB = 1
KIND_SHUTDOWN = 2
HEADER_INTS = 8 + 4 + 2 * 4  # ints, seed parts, float64 pairs
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


# Requests shared by all ranks --------------------------------------------------
@dataclass
class GenRequest:
    """What every rank needs to run one generation."""

    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams
    stop: list = field(default_factory=list)


def encode(req: GenRequest | None) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) int32 arrays; None encodes the shutdown message."""
    header = np.zeros(HEADER_INTS, np.int32)
    header[0] = MAGIC
    if req is None:
        header[1] = KIND_SHUTDOWN
        return header, np.zeros(0, np.int32)
    stop_bytes = np.frombuffer(json.dumps(req.stop).encode("utf-8"), np.uint8).astype(np.int32)
    s = req.sampling
    header[1:8] = [KIND_JOB, len(req.prompt_ids), len(stop_bytes), req.max_tokens, s.top_k,
                   s.repetition_context_size, 0]
    header[8:12] = [(s.seed >> (16 * i)) & 0xFFFF for i in range(4)]
    header[12:20] = np.array([s.temp, s.top_p, s.min_p, s.repetition_penalty], np.float64).view(np.int32)
    payload = np.concatenate([np.asarray(req.prompt_ids, np.int32), stop_bytes])
    return header, payload


def decode(header: np.ndarray, payload: np.ndarray) -> GenRequest | None:
    if int(header[0]) != MAGIC:
        raise RuntimeError(f"serve: bad hand-off header (magic {int(header[0]):#x})")
    if int(header[1]) == KIND_SHUTDOWN:
        return None
    n_ids, n_stop, max_tokens, top_k, rep_ctx = (int(x) for x in header[2:7])
    seed = sum(int(header[8 + i]) << (16 * i) for i in range(4))
    temp, top_p, min_p, rep = (float(x) for x in np.ascontiguousarray(header[12:20]).view(np.float64))
    stop = json.loads(payload[n_ids:n_ids + n_stop].astype(np.uint8).tobytes().decode("utf-8"))
    sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
                              repetition_context_size=rep_ctx, seed=seed)
    return GenRequest(payload[:n_ids].tolist(), max_tokens, sampling, stop)


def exchange(group: Group, req: GenRequest | None = None) -> GenRequest | None:
    """Rank 0 passes `req` (None = shutdown); every rank gets the decoded
    request back (rank 0 too, so all ranks use bit-identical values). Two
    broadcasts: the fixed-size header, then the payload it sizes."""
    header, payload = encode(req) if group.is_root else (None, None)
    header = group.broadcast(header, (HEADER_INTS,))
    n = int(header[2]) + int(header[3]) if int(header[1]) == KIND_JOB else 0
    payload = group.broadcast(payload, (n,)) if n else np.zeros(0, np.int32)
    return decode(header, payload)


# Request validation (rank 0's handler threads) -----------------------------------
class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _num(body, name, default, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}")
    if not integer and not math.isfinite(v):
        raise BadRequest(f"'{name}' must be finite, got {v}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise BadRequest(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {v}")
    return v


def _stops(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 16:
        raise BadRequest("'stop' must be a non-empty string or a list of at most 16 non-empty strings")
    return v


class Service:
    """Rank 0's state: the model, the tokenizer, the job queue."""

    def __init__(self, model, tokenizer, model_id: str, group: Group = SINGLE, max_tokens_cap: int = 4096,
                 max_request_bytes: int = 1_000_000, prefill_step=None, vocab_size: int | None = None):
        self.model = model
        self.tok = tokenizer
        self.model_id = model_id
        self.group = group
        self.max_tokens_cap = max_tokens_cap
        self.max_request_bytes = max_request_bytes
        self.prefill_step = prefill_step
        self.vocab_size = vocab_size or model.args.vocab_size
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.created = int(time.time())

    # -- parse ------------------------------------------------------------------
    def parse(self, body, chat: bool) -> tuple[GenRequest, bool]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if "model" in body and not isinstance(body["model"], str):
            raise BadRequest("'model' must be a string")
        n = _num(body, "n", 1, integer=True)
        if n != 1:
            raise BadRequest("only 'n': 1 is supported")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")
        if chat:
            ids = self._chat_ids(body)
            max_default = self.max_tokens_cap
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            ids = self._completion_ids(body)
            max_default = DEFAULT_COMPLETION_TOKENS
            mt = body.get("max_tokens")
        max_tokens = _num({"max_tokens": mt}, "max_tokens", min(max_default, self.max_tokens_cap), lo=0,
                          hi=self.max_tokens_cap, integer=True)
        seed = body.get("seed")
        if seed is None:
            seed = int.from_bytes(uuid.uuid4().bytes[:8], "little")
        seed = _num({"seed": seed}, "seed", 0, lo=0, hi=SEED_LIMIT - 1, integer=True)
        sampling = SamplingParams(
            temp=float(_num(body, "temperature", 1.0, lo=0)),
            top_p=float(_num(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)),
            top_k=_num(body, "top_k", 0, lo=0, integer=True),
            min_p=float(_num(body, "min_p", 0.0, lo=0, hi=1)),
            repetition_penalty=float(_num(body, "repetition_penalty", 1.0, lo=0, lo_open=True)),
            seed=seed,
        )
        try:
            sampling.validate()
        except UserError as e:
            raise BadRequest(str(e)) from None
        return GenRequest(ids, max_tokens, sampling, _stops(body)), stream

    def _completion_ids(self, body) -> list[int]:
        if "prompt" not in body:
            raise BadRequest("missing field 'prompt'")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            try:
                ids = self.tok.encode(p)
            except Exception as e:  # noqa: BLE001 - tokenizer failure is the request's problem
                raise BadRequest(f"cannot tokenize 'prompt': {e}") from None
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} in 'prompt' is outside the vocabulary [0, {self.vocab_size})")
            ids = list(p)
        else:
            raise BadRequest("'prompt' must be a string, a list of one string, or a non-empty list of token ids")
        if not ids:
            raise BadRequest("'prompt' is empty and the tokenizer adds no BOS token")
        return ids

    def _chat_ids(self, body) -> list[int]:
        if "messages" not in body:
            raise BadRequest("missing field 'messages'")
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                           for part in c):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported")
                c = "".join(part["text"] for part in c)
            if not isinstance(c, str):
                raise BadRequest(f"messages[{i}].content must be a string")
            out.append({"role": m["role"], "content": c})
        try:
            ids = self.tok.chat_ids(out)
        except UserError as e:
            raise BadRequest(str(e)) from None
        if not ids:
            raise BadRequest("the rendered conversation is empty")
        return ids

    # -- run (rank 0's main thread) -------------------------------------------------
    def submit(self, req: GenRequest) -> "Job":
        if self.stopping.is_set():
            raise BadRequest("the server is shutting down", status=503)
        job = Job(req)
        self.jobs.put(job)
        return job

    def loop(self) -> None:
        """Process jobs one at a time until stop(); then send shutdown to the
        other ranks."""
        from .engine import RanksDiverged

        diverged = False
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=0.2)
                except queue.Empty:
                    if self.stopping.is_set():
                        break
                    continue
                if job is None:
                    break
                req = exchange(self.group, job.req)
                try:
                    run_generation(self.model, self.tok, self.group, self.prefill_step, req, job.events.put)
                except RanksDiverged as e:  # raised on every rank: they have all left
                    diverged = True
                    job.events.put(("error", str(e)))
                    raise
                except UserError as e:  # pragma: no cover - validated before queueing
                    job.events.put(("error", str(e)))
                except BaseException as e:  # the server goes down; the waiting client still gets an answer
                    job.events.put(("error", f"generation failed: {type(e).__name__}: {e}"))
                    raise
        finally:
            self.stopping.set()
            if not diverged:
                exchange(self.group, None)
            while True:  # whatever is still queued: answered, not dropped silently
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.events.put(("error", "the server is shutting down"))

    def stop(self) -> None:
        self.stopping.set()
        self.jobs.put(None)


class Job:
    def __init__(self, req: GenRequest):
        self.req = req
        self.events: queue.Queue = queue.Queue()  # ("text", s) ... then ("done", stats) or ("error", msg)


def run_generation(model, tok, group: Group, prefill_step, req: GenRequest, emit=None) -> None:
    """Every rank: the same generation; rank 0 passes `emit` for its events."""
    from .engine import generate_text

    gen = generate_text(model, tok, req.prompt_ids, req.max_tokens, req.sampling, stop=req.stop,
                        prefill_step=prefill_step, group=group)
    while True:
        try:
            text = next(gen)
        except StopIteration as done:
            if emit:
                emit(("done", done.value))
            return
        if emit:
            emit(("text", text))


def follower_loop(model, tok, group: Group, prefill_step=None) -> None:
    """Ranks other than 0: run every job rank 0 hands out until shutdown.
    Signals are left to rank 0, which sends the shutdown message."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, lambda *_: None)
        except ValueError:  # pragma: no cover - not the main thread
            pass
    while True:
        req = exchange(group)
        if req is None:
            return
        run_generation(model, tok, group, prefill_step, req)


# HTTP ---------------------------------------------------------------------------
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _make_handler(svc: Service):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "mlxcel-dist"

        def log_message(self, fmt, *args):  # quiet: one line per request on stderr
            sys.stderr.write(f"serve: {self.address_string()} {fmt % args}\n")

        # -- helpers ------------------------------------------------------------
        def _json(self, status: int, obj) -> None:
            data = json.dumps(obj).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, etype="invalid_request_error") -> None:
            self._json(status, {"error": {"message": message, "type": etype, "param": None, "code": None}})

        def _body(self):
            length = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                self.close_connection = True
                raise BadRequest("chunked request bodies are not supported; send Content-Length", status=411)
            if length is None:
                self.close_connection = True
                raise BadRequest("missing Content-Length", status=411)
            try:
                n = int(length)
            except ValueError:
                self.close_connection = True
                raise BadRequest("bad Content-Length") from None
            if n < 0:
                self.close_connection = True
                raise BadRequest("bad Content-Length")
            if n > svc.max_request_bytes:
                self.close_connection = True  # the unread rest must not be parsed as a request
                # Read (and drop) a body up to 16x the limit so that the client,
                # still sending, gets the 400 rather than a reset connection.
                if n <= 16 * svc.max_request_bytes:
                    left = n
                    while left > 0:
                        got = self.rfile.read(min(left, 1 << 16))
                        if not got:
                            break
                        left -= len(got)
                raise BadRequest(f"request body of {n} bytes is over the limit of {svc.max_request_bytes}")
            raw = self.rfile.read(n)
            try:
                return json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise BadRequest(f"malformed JSON: {e}") from None

        # -- routes -------------------------------------------------------------
        def do_GET(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/v1/models":
                self._json(200, {"object": "list", "data": [
                    {"id": svc.model_id, "object": "model", "created": svc.created, "owned_by": "mlxcel-dist"}]})
            elif path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._error(404, f"no such endpoint: GET {self.path}", "not_found_error")

        def do_POST(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path not in ("/v1/completions", "/v1/chat/completions"):
                # drain a small body so keep-alive stays in sync; else close
                self.close_connection = True
                self._error(404, f"no such endpoint: POST {self.path}", "not_found_error")
                return
            chat = path == "/v1/chat/completions"
            try:
                body = self._body()
                req, stream = svc.parse(body, chat)
                job = svc.submit(req)
            except BadRequest as e:
                self._error(e.status, str(e))
                return
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            if stream:
                self._stream(job, rid, chat, body)
            else:
                self._whole(job, rid, chat, req)

        def _whole(self, job, rid, chat, req):
            parts = []
            while True:
                kind, v = job.events.get()
                if kind == "text":
                    parts.append(v)
                elif kind == "error":
                    self._error(500, v, "server_error")
                    return
                else:
                    stats = v
                    break
            text = "".join(parts)
            finish = FINISH.get(stats.finish_reason, "stop")
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            self._json(200, {
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": svc.model_id, "choices": [choice],
                "usage": {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated,
                          "total_tokens": stats.prompt_tokens + stats.generated},
            })

        def _stream(self, job, rid, chat, body):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            obj = "chat.completion.chunk" if chat else "text_completion"
            created = int(time.time())
            alive = True

            def send(payload):
                nonlocal alive
                if not alive:
                    return
                try:
                    self.wfile.write(b"data: " + payload + b"\n\n")
                    self.wfile.flush()
                except OSError:  # client went away: the generation still runs on every rank
                    alive = False

            def chunk(delta_or_text, finish=None, usage=None):
                if chat:
                    choice = {"index": 0, "delta": delta_or_text, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish}
                d = {"id": rid, "object": obj, "created": created, "model": svc.model_id, "choices": [choice]}
                if usage is not None:
                    d["usage"] = usage
                send(json.dumps(d).encode("utf-8"))

            if chat:
                chunk({"role": "assistant", "content": ""})
            while True:
                kind, v = job.events.get()
                if kind == "text":
                    chunk({"content": v} if chat else v)
                elif kind == "error":
                    send(json.dumps({"error": {"message": v, "type": "server_error"}}).encode("utf-8"))
                    break
                else:
                    usage = None
                    opts = body.get("stream_options")
                    if isinstance(opts, dict) and opts.get("include_usage"):
                        usage = {"prompt_tokens": v.prompt_tokens, "completion_tokens": v.generated,
                                 "total_tokens": v.prompt_tokens + v.generated}
                    chunk({} if chat else "", FINISH.get(v.finish_reason, "stop"), usage)
                    break
            send(b"[DONE]")

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(svc: Service, host: str, port: int) -> None:
    """Rank 0: bind, serve in a thread, process jobs here until SIGINT/SIGTERM."""
    try:
        httpd = _Server((host, port), _make_handler(svc))
    except OSError as e:
        svc.stopping.set()
        exchange(svc.group, None)  # release the other ranks
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    saved = {}

    def on_signal(signum, _frame):
        svc.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        saved[sig] = signal.signal(sig, on_signal)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    h, p = httpd.server_address[:2]
    print(f"serve: {svc.model_id} on http://{h}:{p}/v1 (np {svc.group.size()})",
          file=sys.stderr, flush=True)
    try:
        svc.loop()
    finally:
        httpd.shutdown()
        httpd.server_close()
        for sig, old in saved.items():
            signal.signal(sig, old)
        print("serve: stopped", file=sys.stderr, flush=True)
