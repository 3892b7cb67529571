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
   logprobs setting (0 = off, k + 1 = the drawn token's and the top k), the
   seed in four 16-bit parts, and the float64 sampling values (temperature,
   top_p, min_p, repetition penalty) bit-copied as int32 pairs, so every rank
   samples with the very same values rank 0 does;
2. an int32 payload: the prompt ids, then the UTF-8 bytes of the stop strings
   (JSON list).

Shutdown during a generation: every rank must stop at the same token (the
model's collectives pair up), so rank 0 cannot simply stop. Every
CANCEL_EVERY generated tokens all ranks schedule one one-int all_sum of rank
0's "stopping" flag (lazily, beside the decode steps) and read the one
scheduled CANCEL_EVERY tokens before, which is done by then, so the check
never stalls the pipelined decode; at np 1 rank 0 reads its flag at every
token. When it is set, every rank leaves the generation at that same token,
rank 0 answers the request (an SSE error chunk and ``data: [DONE]``, or HTTP
503), answers what is still queued with 503, and sends the shutdown message;
each other rank prints ``serve: rank N stopped`` when it gets it.
"""

from __future__ import annotations

import json
import math
import queue
import re
import signal
import sys
import threading
import time
import uuid
from contextlib import contextmanager
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
DEFAULT_CHAT_TOKENS = 512  # mlx-lm's server default (--max-tokens 512)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs
CANCEL_EVERY = 4  # tokens between two shutdown checks when there are other ranks
SHUTDOWN_MESSAGE = "the server is shutting down"
SHUTDOWN_WAIT_S = 10.0  # at shutdown, how long rank 0 waits for handlers still answering


# Requests shared by all ranks --------------------------------------------------
@dataclass
class GenRequest:
    """What every rank needs to run one generation."""

    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams
    stop: list = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: each token's logprob and the k most likely


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
                   s.repetition_context_size, 0 if req.logprobs is None else req.logprobs + 1]
    header[8:12] = [(s.seed >> (16 * i)) & 0xFFFF for i in range(4)]
    header[12:20] = np.array([s.temp, s.top_p, s.min_p, s.repetition_penalty], np.float64).view(np.int32)
    payload = np.concatenate([np.asarray(req.prompt_ids, np.int32), stop_bytes])
    return header, payload


def decode(header: np.ndarray, payload: np.ndarray) -> GenRequest | None:
    if int(header[0]) != MAGIC:
        raise RuntimeError(f"serve: bad hand-off header (magic {int(header[0]):#x})")
    if int(header[1]) == KIND_SHUTDOWN:
        return None
    n_ids, n_stop, max_tokens, top_k, rep_ctx, lp = (int(x) for x in header[2:8])
    seed = sum(int(header[8 + i]) << (16 * i) for i in range(4))
    temp, top_p, min_p, rep = (float(x) for x in np.ascontiguousarray(header[12:20]).view(np.float64))
    stop = json.loads(payload[n_ids:n_ids + n_stop].astype(np.uint8).tobytes().decode("utf-8"))
    sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
                              repetition_context_size=rep_ctx, seed=seed)
    return GenRequest(payload[:n_ids].tolist(), max_tokens, sampling, stop, None if lp == 0 else lp - 1)


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
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def _num(body, name, default, lo=None, hi=None, lo_open=False, integer=False):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}",
                         param=name)
    if not integer and not math.isfinite(v):
        raise BadRequest(f"'{name}' must be finite, got {v}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise BadRequest(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {v}", param=name)
    return v


def _text(s: str, where: str) -> str:
    """`s` if it is text the tokenizer can take (JSON's \\ud800-style escapes
    can carry lone UTF-16 surrogates, which are not Unicode text)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{where} is not valid Unicode text: a lone UTF-16 surrogate "
                         f"U+{ord(s[e.start]):04X} at character {e.start}",
                         param=where.strip("'").split("[")[0]) from None
    return s


def _stops(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 16:
        raise BadRequest("'stop' must be a non-empty string or a list of at most 16 non-empty strings", param="stop")
    return [_text(s, "'stop'") for s in v]


# OpenAI request fields this server does not implement: a request that asks
# for one (any value but the neutral ones) gets HTTP 400 naming it, never a
# silently different answer. Fields without effect on the output (user,
# metadata, store, service_tier, parallel_tool_calls, ...) are accepted.
def _neutral(*values):
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in values)


UNSUPPORTED = {
    "n": (_neutral(1), "one choice per request ('n': 1)"),
    "best_of": (_neutral(1), "one candidate per request ('best_of': 1)"),
    "echo": (_neutral(False), "the prompt is not echoed"),
    "suffix": (_neutral(""), "no insertion (suffix) mode"),
    "tools": (_neutral([]), "no tool calling"),
    "tool_choice": (_neutral("none", "auto"), "no tool calling"),
    "functions": (_neutral([]), "no function calling"),
    "function_call": (_neutral("none", "auto"), "no function calling"),
    "logit_bias": (_neutral({}), "no logit bias"),
    "presence_penalty": (_neutral(0, 0.0), "no presence penalty (use 'repetition_penalty')"),
    "frequency_penalty": (_neutral(0, 0.0), "no frequency penalty (use 'repetition_penalty')"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "text output only (no JSON mode or schema)"),
    "modalities": (lambda v: v is None or v == ["text"], "text output only"),
    "audio": (_neutral(), "text output only"),
    "prediction": (_neutral(), "no predicted outputs"),
    "web_search_options": (_neutral(), "no web search"),
    "reasoning_effort": (_neutral(), "no reasoning-effort control"),
}


def _check_unsupported(body) -> None:
    for name, (ok, why) in UNSUPPORTED.items():
        if name in body and not ok(body[name]):
            raise BadRequest(f"'{name}' is not supported by this server: {why}; got {json.dumps(body[name])}",
                             param=name, code="unsupported_parameter")


def context_limit(config: dict | None) -> int | None:
    """The model's context length: config.json's max_position_embeddings
    (a multimodal config's text_config); None when it gives none."""
    config = config or {}
    v = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def context_error(limit: int, prompt: int, completion: int) -> BadRequest:
    """vLLM's wording, OpenAI's code."""
    return BadRequest(
        f"This model's maximum context length is {limit} tokens. However, you requested {prompt + completion} "
        f"tokens ({prompt} in the messages, {completion} in the completion). Please reduce the length of the "
        "messages or completion.", param="messages", code="context_length_exceeded")


# mlx-lm's server (convert_chat) renders a conversation this way when the
# checkpoint has no chat template; so does this server.
DEFAULT_ROLE_MAPPING = {
    "system_prompt": ("A chat between a curious user and an artificial intelligence assistant. "
                      "The assistant follows the given rules no matter what."),
    "system": "ASSISTANT's RULE: ",
    "user": "USER: ",
    "assistant": "ASSISTANT: ",
    "stop": "\n",
}


def convert_chat(messages: list[dict], role_mapping: dict | None = None) -> str:
    """mlx-lm's plain rendering: `<role prefix><content><stop>` per message,
    then the assistant prefix, trailing whitespace stripped."""
    role_mapping = role_mapping or DEFAULT_ROLE_MAPPING
    prompt = ""
    for m in messages:
        prompt += f"{role_mapping.get(m['role'], '')}{m.get('content', '')}{role_mapping.get('stop', '')}"
    prompt += role_mapping.get("assistant", "")
    return prompt.rstrip()


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable character table (byte-level BPE vocabularies), inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenPieces:
    """A token id's text and UTF-8 bytes, as OpenAI's logprobs show them (a
    token that is part of a character: "bytes:\\xe2\\x80")."""

    BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer):
        self.raw = getattr(tokenizer, "_tok", None)  # the `tokenizers` object behind tokenizer.Tokenizer
        self.tok = tokenizer
        self.byte_level = self.raw is not None and "ByteLevel" in repr(self.raw.decoder)
        self.byte_map = _bytes_to_unicode() if self.byte_level else {}
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, i: int) -> bytes:
        if self.raw is None:
            return self.tok.decode([i]).encode("utf-8")
        s = self.raw.id_to_token(i)
        if s is None:
            return b""
        if m := self.BYTE_TOKEN.fullmatch(s):  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        if self.byte_level and all(c in self.byte_map for c in s):
            return bytes(self.byte_map[c] for c in s)
        return s.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker

    def __call__(self, i: int) -> tuple[str, list[int]]:
        hit = self.cache.get(i)
        if hit is None:
            b = self._bytes(i)
            try:
                text = b.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{c:02x}" for c in b)
            hit = self.cache[i] = (text, list(b))
        return hit


def _lp(v: float) -> float:
    return v if math.isfinite(v) else -9999.0  # OpenAI's value for an impossible token; JSON has no -inf


@dataclass
class Defaults:
    """Server-wide defaults a request may override (serve's --temp ... flags)."""

    temp: float = 1.0  # OpenAI's default (mlx-lm's server: 0)
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None  # None: 512 for chat (mlx-lm's), 16 for completions (OpenAI's)


class Service:
    """Rank 0's state: the model, the tokenizer, the job queue."""

    def __init__(self, model, tokenizer, model_id: str, group: Group = SINGLE, max_tokens_cap: int = 4096,
                 max_request_bytes: int = 1_000_000, prefill_step=None, vocab_size: int | None = None,
                 context_length: int | None = None, defaults: Defaults | None = None):
        self.model = model
        self.tok = tokenizer
        self.model_id = model_id
        self.group = group
        self.max_tokens_cap = max_tokens_cap
        self.max_request_bytes = max_request_bytes
        self.prefill_step = prefill_step
        self.vocab_size = vocab_size or model.args.vocab_size
        self.context_length = context_length
        self.defaults = defaults or Defaults()
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # submit vs the final drain: every queued job is answered
        self.idle = threading.Condition()
        self.inflight = 0  # POST handlers not done answering
        self.created = int(time.time())
        self.pieces = TokenPieces(tokenizer)
        self.plain_chat = self._no_chat_template()

    def _no_chat_template(self) -> bool:
        """True when the checkpoint has no chat template: chat requests are then
        rendered as mlx-lm's server renders them (convert_chat)."""
        try:
            self.tok.chat_template()
        except UserError as e:
            return "no chat template" in str(e)
        return False

    # -- parse ------------------------------------------------------------------
    def parse(self, body, chat: bool) -> tuple[GenRequest, bool]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if "model" in body and not isinstance(body["model"], str):
            raise BadRequest("'model' must be a string", param="model")
        _check_unsupported(body)
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false", param="stream")
        logprobs = self._logprobs(body, chat)
        if chat:
            ids = self._chat_ids(body)
            max_default = DEFAULT_CHAT_TOKENS
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            ids = self._completion_ids(body)
            max_default = DEFAULT_COMPLETION_TOKENS
            mt = body.get("max_tokens")
        if self.defaults.max_tokens is not None:
            max_default = self.defaults.max_tokens
        max_default = min(max_default, self.max_tokens_cap)
        max_tokens = _num({"max_tokens": mt}, "max_tokens", max_default, lo=0, hi=self.max_tokens_cap, integer=True)
        limit, P = self.context_length, len(ids)
        if limit is not None:
            if mt is None and P < limit:  # a default, not the client's number: what fits
                max_tokens = min(max_tokens, limit - P)
            if P + max_tokens > limit:
                raise context_error(limit, P, max_tokens)
        seed = body.get("seed")
        if seed is None:
            seed = int.from_bytes(uuid.uuid4().bytes[:8], "little")
        seed = _num({"seed": seed}, "seed", 0, lo=0, hi=SEED_LIMIT - 1, integer=True)
        d = self.defaults
        sampling = SamplingParams(
            temp=float(_num(body, "temperature", d.temp, lo=0)),
            top_p=float(_num(body, "top_p", d.top_p, lo=0, hi=1, lo_open=True)),
            top_k=_num(body, "top_k", d.top_k, lo=0, integer=True),
            min_p=float(_num(body, "min_p", d.min_p, lo=0, hi=1)),
            repetition_penalty=float(_num(body, "repetition_penalty", 1.0, lo=0, lo_open=True)),
            seed=seed,
        )
        try:
            sampling.validate()
        except UserError as e:
            raise BadRequest(str(e)) from None
        return GenRequest(ids, max_tokens, sampling, _stops(body), logprobs), stream

    @staticmethod
    def _logprobs(body, chat: bool) -> int | None:
        """None (off) or k: OpenAI's chat form (`logprobs: true`, `top_logprobs:
        k`), its completions form (`logprobs: k`); completions also take the
        chat form, as mlx-lm's server does."""
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp is None or lp is False:
            if top not in (None, 0, -1) or isinstance(top, bool):  # mlx-lm's "none" is -1
                raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        if lp is True:
            return 0 if top in (None, -1) else _num(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        if chat:
            raise BadRequest(f"'logprobs' must be true or false, got {json.dumps(lp)} (the number of alternatives "
                             "is 'top_logprobs')", param="logprobs")
        if top is not None:
            raise BadRequest("give 'logprobs': k, or 'logprobs': true with 'top_logprobs': k, not both numbers",
                             param="top_logprobs")
        return _num(body, "logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)

    def _encode(self, text: str, where: str) -> list[int]:
        _text(text, where)
        try:
            return self.tok.encode(text)
        except Exception as e:  # noqa: BLE001 - a tokenizer failure is the request's problem
            raise BadRequest(f"the tokenizer cannot take {where}: {type(e).__name__}: {e}",
                             param=where.strip("'")) from None

    def _completion_ids(self, body) -> list[int]:
        if "prompt" not in body:
            raise BadRequest("missing field 'prompt'", param="prompt")
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            ids = self._encode(p, "'prompt'")
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} in 'prompt' is outside the vocabulary [0, {self.vocab_size})",
                                 param="prompt")
            ids = list(p)
        else:
            raise BadRequest("'prompt' must be a string, a list of one string, or a non-empty list of token ids",
                             param="prompt")
        if not ids:
            raise BadRequest("'prompt' is empty and the tokenizer adds no BOS token", param="prompt")
        return ids

    def _chat_ids(self, body) -> list[int]:
        if "messages" not in body:
            raise BadRequest("missing field 'messages'", param="messages")
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                           for part in c):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", param="messages")
                c = "".join(part["text"] for part in c)
            if not isinstance(c, str):
                raise BadRequest(f"messages[{i}].content must be a string", param="messages")
            out.append({"role": _text(m["role"], f"messages[{i}].role"), "content": _text(c, f"messages[{i}].content")})
        if self.plain_chat:
            rm = body.get("role_mapping")
            if rm is not None and not (isinstance(rm, dict) and all(isinstance(v, str) for v in rm.values())):
                raise BadRequest("'role_mapping' must be an object of strings", param="role_mapping")
            ids = self._encode(convert_chat(out, rm), "'messages'")
        else:
            try:
                ids = self.tok.chat_ids(out)
            except UserError as e:
                raise BadRequest(str(e), param="messages") from None
            except Exception as e:  # noqa: BLE001 - a tokenizer failure is the request's problem
                raise BadRequest(f"the tokenizer cannot take the rendered messages: {type(e).__name__}: {e}",
                                 param="messages") from None
        if not ids:
            raise BadRequest("the rendered conversation is empty", param="messages")
        return ids

    # -- run (rank 0's main thread) -------------------------------------------------
    def submit(self, req: GenRequest) -> "Job":
        with self.lock:
            if self.stopping.is_set():
                raise BadRequest(SHUTDOWN_MESSAGE, status=503)
            job = Job(req)
            self.jobs.put(job)
        return job

    @contextmanager
    def answering(self):
        """Counts a POST handler until it has answered (shutdown waits for it)."""
        with self.idle:
            self.inflight += 1
        try:
            yield
        finally:
            with self.idle:
                self.inflight -= 1
                self.idle.notify_all()

    def wait_answered(self, timeout: float = SHUTDOWN_WAIT_S) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.inflight == 0, timeout)

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
                if self.stopping.is_set():  # queued before the signal: answered, not run
                    job.events.put(("error", SHUTDOWN_MESSAGE, 503))
                    continue
                req = exchange(self.group, job.req)
                try:
                    run_generation(self.model, self.tok, self.group, self.prefill_step, req, job.events.put,
                                   self.stopping)
                except Cancelled:  # every rank left the generation at the same token
                    job.events.put(("error", SHUTDOWN_MESSAGE, 503))
                except RanksDiverged as e:  # raised on every rank: they have all left
                    diverged = True
                    job.events.put(("error", str(e), 500))
                    raise
                except UserError as e:  # refused on every rank alike, before any collective
                    job.events.put(("error", str(e), 400))
                except BaseException as e:  # the server goes down; the waiting client still gets an answer
                    job.events.put(("error", f"generation failed: {type(e).__name__}: {e}", 500))
                    raise
        finally:
            with self.lock:
                self.stopping.set()
            if not diverged:
                exchange(self.group, None)
            while True:  # whatever is still queued: answered, not dropped silently
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.events.put(("error", SHUTDOWN_MESSAGE, 503))

    def stop(self) -> None:
        self.stopping.set()
        self.jobs.put(None)


class Job:
    def __init__(self, req: GenRequest):
        self.req = req
        # ("token", id, (logprob, top)) with logprobs, ("text", s) ... then
        # ("done", stats) or ("error", message, http status)
        self.events: queue.Queue = queue.Queue()


class Cancelled(Exception):
    """Every rank left a generation at the same token: the server stops."""


def run_generation(model, tok, group: Group, prefill_step, req: GenRequest, emit=None, stopping=None) -> None:
    """Every rank: the same generation; rank 0 passes `emit` for its events
    and `stopping`, the flag that (broadcast every CANCEL_EVERY tokens) makes
    every rank raise Cancelled at the same token."""
    from .engine import generate_text

    import mlx.core as mx

    every = 1 if group.single else CANCEL_EVERY
    count = 0
    flag = None  # the lazy all_sum of rank 0's flag, scheduled `every` tokens ago

    def stopping_now() -> int:
        return int(group.is_root and stopping is not None and stopping.is_set())

    def on_token(tok_id, entry):
        nonlocal count, flag
        if emit and req.logprobs is not None:
            emit(("token", tok_id, entry))
        count += 1
        if count % every:
            return
        if group.single:
            if stopping_now():
                raise Cancelled
            return
        # Read the flag scheduled `every` tokens ago (long done: no stall of
        # the pipelined decode), then schedule the next one. Every rank does
        # both at the same token, so the all_sums pair and all decide alike.
        if flag is not None and int(np.array(flag)[0]):
            raise Cancelled
        flag = group.all_sum(mx.array([stopping_now()], dtype=mx.int32))
        mx.async_eval(flag)

    gen = generate_text(model, tok, req.prompt_ids, req.max_tokens, req.sampling, stop=req.stop,
                        prefill_step=prefill_step, group=group, logprobs=req.logprobs, on_token=on_token)
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
            print(f"serve: rank {group.rank()} stopped", file=sys.stderr, flush=True)
            return
        try:
            run_generation(model, tok, group, prefill_step, req)
        except Cancelled:  # rank 0 is stopping: its shutdown message comes next
            pass
        except UserError:  # refused on every rank alike (e.g. logprobs for a model with its own loop); rank 0 answers
            pass


# HTTP ---------------------------------------------------------------------------
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
COMPLETIONS = ("/v1/completions", "/completions")
CHAT = ("/v1/chat/completions", "/chat/completions")  # without /v1 too, as mlx-lm's server


def chat_logprobs(pieces: TokenPieces, entries) -> dict:
    """OpenAI's chat `logprobs` object for (id, (logprob, top)) entries."""
    def one(i, v):
        text, b = pieces(i)
        return {"token": text, "logprob": _lp(v), "bytes": b}

    return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, (lp, top) in entries]}


def completion_logprobs(pieces: TokenPieces, entries, offset: int) -> tuple[dict, int]:
    """OpenAI's (legacy) completions `logprobs` object; `offset`: the text
    offset of the first token, returned advanced past the last."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, (lp, top) in entries:
        text = pieces(t)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp))
        out["top_logprobs"].append({pieces(i)[0]: _lp(v) for i, v in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


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

        def _error(self, status: int, message: str, etype=None, param=None, code=None) -> None:
            if etype is None:
                etype = "invalid_request_error" if status < 500 else "server_error"
            self._json(status, {"error": {"message": message, "type": etype, "param": param, "code": code}})

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
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadRequest(f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset "
                                 f"{e.start} ({e.reason}); send JSON encoded as UTF-8") from None
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise BadRequest(f"malformed JSON: {e}") from None

        # -- routes -------------------------------------------------------------
        def do_GET(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path in ("/v1/models", "/models"):
                self._json(200, {"object": "list", "data": [
                    {"id": svc.model_id, "object": "model", "created": svc.created, "owned_by": "mlxcel-dist"}]})
            elif path == "/health":  # as mlx-lm's: 200 ok; 503 unavailable once shutting down
                if svc.stopping.is_set():
                    self._json(503, {"status": "unavailable"})
                else:
                    self._json(200, {"status": "ok"})
            else:
                self._error(404, f"no such endpoint: GET {self.path}", "not_found_error")

        def do_POST(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path not in COMPLETIONS + CHAT:
                # drain a small body so keep-alive stays in sync; else close
                self.close_connection = True
                self._error(404, f"no such endpoint: POST {self.path}", "not_found_error")
                return
            chat = path in CHAT
            with svc.answering():
                try:
                    body = self._body()
                    req, stream = svc.parse(body, chat)
                    job = svc.submit(req)
                except BadRequest as e:
                    self._error(e.status, str(e), param=e.param, code=e.code)
                    return
                rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
                if stream:
                    self._stream(job, rid, chat, body)
                else:
                    self._whole(job, rid, chat, req)

        def _whole(self, job, rid, chat, req):
            parts, entries = [], []
            while True:
                kind, *v = job.events.get()
                if kind == "token":
                    entries.append(tuple(v))
                elif kind == "text":
                    parts.append(v[0])
                elif kind == "error":
                    message, status = v
                    self._error(status, message)
                    return
                else:
                    stats = v[0]
                    break
            text = "".join(parts)
            finish = FINISH.get(stats.finish_reason, "stop")
            if chat:
                lp = chat_logprobs(svc.pieces, entries) if req.logprobs is not None else None
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                          "finish_reason": finish}
            else:
                lp = completion_logprobs(svc.pieces, entries, 0)[0] if req.logprobs is not None else None
                choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
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
            want_lp = job.req.logprobs is not None
            pending = []  # (id, (logprob, top)) of tokens whose text is not sent yet
            offset = 0

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
                nonlocal offset
                lp = None
                if want_lp and pending:
                    if chat:
                        lp = chat_logprobs(svc.pieces, pending)
                    else:
                        lp, offset = completion_logprobs(svc.pieces, pending, offset)
                    pending.clear()
                if chat:
                    choice = {"index": 0, "delta": delta_or_text, "logprobs": lp, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": delta_or_text, "logprobs": lp, "finish_reason": finish}
                d = {"id": rid, "object": obj, "created": created, "model": svc.model_id, "choices": [choice]}
                if usage is not None:
                    d["usage"] = usage
                send(json.dumps(d).encode("utf-8"))

            if chat:
                chunk({"role": "assistant", "content": ""})
            while True:
                kind, *v = job.events.get()
                if kind == "token":
                    pending.append(tuple(v))
                elif kind == "text":
                    chunk({"content": v[0]} if chat else v[0])
                elif kind == "error":
                    message, status = v
                    send(json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                               "code": status}}).encode("utf-8"))
                    break
                else:
                    stats = v[0]
                    usage = None
                    opts = body.get("stream_options")
                    if isinstance(opts, dict) and opts.get("include_usage"):
                        usage = {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated,
                                 "total_tokens": stats.prompt_tokens + stats.generated}
                    chunk({} if chat else "", FINISH.get(stats.finish_reason, "stop"), usage)
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
    if svc.plain_chat:
        print(f"serve: {svc.model_id} has no chat template: chat requests are rendered as plain "
              "'USER: ... ASSISTANT:' text (as mlx-lm's server)", file=sys.stderr, flush=True)
    print(f"serve: {svc.model_id} on http://{h}:{p}/v1 (np {svc.group.size()})",
          file=sys.stderr, flush=True)
    try:
        svc.loop()
    finally:
        # every request was answered (or errored) by the loop; let the
        # handlers finish writing before the process (and its daemon threads) ends
        svc.wait_answered()
        httpd.shutdown()
        httpd.server_close()
        for sig, old in saved.items():
            signal.signal(sig, old)
        print("serve: stopped", file=sys.stderr, flush=True)
