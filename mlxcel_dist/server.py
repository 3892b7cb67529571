"""`mlxcel-dist serve`: an OpenAI-compatible HTTP server (standard library only).

Rank 0 runs a ``ThreadingHTTPServer``: handler threads parse and validate each
request, tokenize its prompt (chat template included) and put a job into one
queue. Rank 0's main thread is the batch scheduler (:meth:`Service.loop_batched`,
described at "Batched serving" below): it admits jobs into a
``batch.BatchEngine`` between decode steps, shares each step's changes with
the other ranks (which run :func:`follower_batch_loop`), detokenises each row
and feeds the waiting handler (all at once, or as SSE chunks with ``stream:
true``). At np 1 no collective runs.

Models with their own generation loop (``generate_ids``) are served one job at
a time (:meth:`Service.loop_sequential`, :func:`follower_loop`): each job is
handed to every rank by :func:`exchange` (over the host channel, where idle
ranks wait asleep), then all ranks run the same :func:`engine.generate_text`.

The hand-off encoding (:func:`encode`; :func:`exchange` sends it as one
host-channel message, or without the channel as two all_sums in which rank 0
contributes the data and every other rank zeros, x + 0 = x, exact for
integers; the batched path puts the same encoding in its step payload):

1. a fixed-size int32 header: magic, kind (job/shutdown), prompt length,
   stop-strings byte count, max_tokens, top_k, repetition context size, the
   logprobs setting (0 = off, k + 1 = the drawn token's and the top k),
   ignore_eos (0 / 1), the seed in four 16-bit parts, and the float64
   sampling values (temperature, top_p, min_p, repetition penalty) bit-copied
   as int32 pairs, so every rank samples with the very same values rank 0 does;
2. an int32 payload: the prompt ids, then the UTF-8 bytes of the stop strings
   (JSON list).

Shutdown during a sequential generation: every rank must stop at the same token (the
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

import functools
import json
import math
import queue
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from .collectives import SINGLE, Group, HostChannel
from .errors import UserError
from .sampling import SEED_LIMIT, SamplingParams

MAGIC = 0x4D4C5853  # "MLXS"
KIND_JOB = 1
KIND_SHUTDOWN = 2
HEADER_INTS = 9 + 4 + 2 * 4  # ints, seed parts, float64 pairs
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512  # mlx-lm's server default (--max-tokens 512)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs
CANCEL_EVERY = 4  # tokens between two shutdown checks when there are other ranks
SHUTDOWN_MESSAGE = "the server is shutting down"
SHUTDOWN_WAIT_S = 10.0  # at shutdown, how long rank 0 waits for handlers still answering
KIND_STEP = 3
KIND_IDLE = 4
CONTROL_INTS = 4  # magic, kind, payload length, idle milliseconds
IDLE_AFTER_S = 0.5  # a client's next request usually comes sooner: no idle delay between back-to-back requests
IDLE_SLEEP_S = 0.3
IDLE_MARGIN_S = 0.02
POLL_S = 0.25  # a waiting handler checks its client's connection this often
# After SIGTERM, the scheduler is judged stuck in a collective of a dead rank
# when its current step (collectives included; admissions' prefills excepted)
# had already run max(STUCK_S, STUCK_STEPS x its recent step time) when the
# signal came (mpirun sends SIGTERM ~0.25 s after a rank dies and SIGKILL
# ~0.25 s later: this must be quick), or runs on for max(STUCK_LATE_S,
# 10 x STUCK_STEPS x the step time) after it (a slow but live step on a
# loaded host must not be cut).
STUCK_S = 0.1
STUCK_STEPS = 4
STUCK_LATE_S = 1.0
DEFAULT_DECODE_CONCURRENCY = 32  # mlx-lm's --decode-concurrency
DEFAULT_PROMPT_CONCURRENCY = 8  # mlx-lm's --prompt-concurrency
DEFAULT_PROMPT_CACHE_SIZE = 10  # mlx-lm's --prompt-cache-size


# Requests shared by all ranks --------------------------------------------------
@dataclass
class GenRequest:
    """What every rank needs to run one generation."""

    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams
    stop: list = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: each token's logprob and the k most likely
    ignore_eos: bool = False  # vLLM's extra field: EOS is an ordinary token (runs to max_tokens or a stop string)


def encode(req: GenRequest | None) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) int32 arrays; None encodes the shutdown message."""
    header = np.zeros(HEADER_INTS, np.int32)
    header[0] = MAGIC
    if req is None:
        header[1] = KIND_SHUTDOWN
        return header, np.zeros(0, np.int32)
    stop_bytes = np.frombuffer(json.dumps(req.stop).encode("utf-8"), np.uint8).astype(np.int32)
    s = req.sampling
    header[1:9] = [KIND_JOB, len(req.prompt_ids), len(stop_bytes), req.max_tokens, s.top_k,
                   s.repetition_context_size, 0 if req.logprobs is None else req.logprobs + 1, int(req.ignore_eos)]
    header[9:13] = [(s.seed >> (16 * i)) & 0xFFFF for i in range(4)]
    header[13:21] = np.array([s.temp, s.top_p, s.min_p, s.repetition_penalty], np.float64).view(np.int32)
    payload = np.concatenate([np.asarray(req.prompt_ids, np.int32), stop_bytes])
    return header, payload


def decode(header: np.ndarray, payload: np.ndarray) -> GenRequest | None:
    if int(header[0]) != MAGIC:
        raise RuntimeError(f"serve: bad hand-off header (magic {int(header[0]):#x})")
    if int(header[1]) == KIND_SHUTDOWN:
        return None
    n_ids, n_stop, max_tokens, top_k, rep_ctx, lp, ignore_eos = (int(x) for x in header[2:9])
    seed = sum(int(header[9 + i]) << (16 * i) for i in range(4))
    temp, top_p, min_p, rep = (float(x) for x in np.ascontiguousarray(header[13:21]).view(np.float64))
    stop = json.loads(payload[n_ids:n_ids + n_stop].astype(np.uint8).tobytes().decode("utf-8"))
    sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
                              repetition_context_size=rep_ctx, seed=seed)
    return GenRequest(payload[:n_ids].tolist(), max_tokens, sampling, stop, None if lp == 0 else lp - 1,
                      bool(ignore_eos))


def exchange(group: Group, req: GenRequest | None = None, channel=None) -> GenRequest | None:
    """Rank 0 passes `req` (None = shutdown); every rank gets the decoded
    request back (rank 0 too, so all ranks use bit-identical values). Over
    the host channel when there is one (the other ranks wait for it asleep
    in recv); else two broadcasts: the fixed-size header, then the payload
    it sizes (an idle follower then waits inside a collective)."""
    header, payload = encode(req) if group.is_root else (None, None)
    if channel is not None:
        _, msg = channel.exchange([0], np.concatenate([header, payload]) if group.is_root else None)
        return decode(msg[:HEADER_INTS], msg[HEADER_INTS:])
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
                 context_length: int | None = None, defaults: Defaults | None = None,
                 decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY,
                 prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY,
                 prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE, prompt_cache_bytes: int | None = None,
                 warmup: bool = False):
        self.model = model
        self.warmup = warmup  # compile the batch step for every row capacity before the first request
        self.engine = None  # BatchEngine (batched models), made by prepare()
        self.prepared = False
        self.channel = None  # collectives.HostChannel to the other ranks (None: np 1, or none could be built)
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = prompt_concurrency
        self.prompt_cache_size = prompt_cache_size
        self.prompt_cache_bytes = prompt_cache_bytes
        self.batched = batchable(model)
        self.open_jobs: set = set()  # submitted, not answered yet (a stuck main thread fails them all)
        self.loop_done = threading.Event()
        self.busy_since = None  # when the scheduler entered its current step (None: between steps)
        self.step_s = 0.0  # moving average of a step's time
        self.times = StepTimes()  # where the batched loop's time went (printed when it ends)
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
        ignore_eos = body.get("ignore_eos")
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise BadRequest(f"'ignore_eos' must be true or false, got {json.dumps(ignore_eos)}", param="ignore_eos")
        return GenRequest(ids, max_tokens, sampling, _stops(body), logprobs, bool(ignore_eos)), stream

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
            self.open_jobs.add(job)
            self.jobs.put(job)
        return job

    def closed(self, job: "Job") -> None:
        """Its handler is done with it (answered, or the client went away)."""
        job.cancelled.set()
        with self.lock:
            self.open_jobs.discard(job)

    def fail_all(self, message: str, status: int) -> int:
        """Answer every open job with an error (the main thread may be stuck
        in a collective); returns how many."""
        with self.lock:
            self.stopping.set()
            jobs, self.open_jobs = list(self.open_jobs), set()
        for job in jobs:
            job.events.put(("error", message, status))
        return len(jobs)

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
        try:
            if self.batched:
                self.loop_batched()
            else:
                self.loop_sequential()
        finally:
            self.loop_done.set()

    def loop_sequential(self) -> None:
        """Process jobs one at a time until stop(); then send shutdown to the
        other ranks (models with their own generation loop: no batching)."""
        from .engine import RanksDiverged

        diverged = False
        self.prepare()
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
                req = exchange(self.group, job.req, self.channel)
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
                exchange(self.group, None, self.channel)
            if self.channel is not None:
                self.channel.close()
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

    # -- batched (rank 0's scheduler) ----------------------------------------------
    def prepare(self) -> None:
        """Rank 0, before the HTTP thread starts: the host channel and (batched
        models) the engine and its warm-up, each paired with the other ranks'
        same calls in follower_batch_loop / follower_loop. Idempotent."""
        if self.prepared:
            return
        self.prepared = True
        group = self.group
        if self.batched:
            self.engine = make_engine(self.model, self.prefill_step, self.prompt_cache_size,
                                      self.prompt_cache_bytes, logprobs=True)
        self.channel = HostChannel.open(group)  # None at np 1, or where a rank could not connect
        if self.channel is None and not group.single:
            print("serve: no host channel to every rank (TCP to rank 0 refused or unreachable): step control "
                  "and request hand-offs go through device collectives (they wait behind the step in flight, "
                  "and idle ranks wait inside one)", file=sys.stderr, flush=True)
        if self.warmup and self.batched:
            warm_up(self.engine, self.decode_concurrency, group)

    def loop_batched(self) -> None:
        """Admit, step, detokenise and retire rows until stop(); every other
        rank runs follower_batch_loop's mirror of the same engine calls."""
        from .engine import GenStats, RankAgreement, RanksDiverged
        from .tokenizer import StopStrings, StreamDecoder

        group = self.group
        self.prepare()
        eng, channel = self.engine, self.channel
        guard = RankAgreement(group, every=0)
        active: dict[int, Active] = {}
        backlog: list = []  # jobs taken from the queue, not admitted yet
        removals: list = []  # rows to free at the next step
        outbox: list = []  # (job, event) of the last step: sent after the step's agreement verdict
        next_rid = 0
        idle = False  # the last sync was an IDLE note
        idle_until = 0.0

        def finish(rid, a, reason):
            st = a.stats
            st.finish_reason = reason
            if reason != "stop":
                tail = a.stopper.feed(a.decoder.flush()) + a.stopper.flush()
                if tail:
                    outbox.append((a.job, ("text", tail)))
            outbox.append((a.job, ("done", st)))
            removals.append(rid)
            del active[rid]

        def take(timeout=None) -> bool:
            """Move queued jobs into the backlog (waiting up to `timeout` for
            the first); False on the stop sentinel."""
            try:
                job = self.jobs.get(timeout=timeout) if timeout is not None else self.jobs.get_nowait()
            except queue.Empty:
                return True
            while True:
                if job is None:
                    return False
                backlog.append(job)
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    return True

        shutdown_sent = False
        t_rest = time.monotonic()
        try:
            while True:
                take()
                if not active:  # no row ran since: waiting is not a step's rest
                    t_rest = time.monotonic()
                for rid in [rid for rid, a in active.items() if a.job.cancelled.is_set()]:
                    removals.append(rid)  # the client went away: free its row now
                    print(f"serve: client gone: row freed after {active[rid].stats.generated} of "
                          f"{active[rid].job.req.max_tokens} tokens", file=sys.stderr, flush=True)
                    del active[rid]
                admissions = []
                stopping = self.stopping.is_set()
                if not stopping:
                    keep = []
                    for job in backlog:
                        if job.cancelled.is_set():
                            print("serve: client gone: request dropped before it took a row", file=sys.stderr,
                                  flush=True)
                            continue
                        if job.req.max_tokens == 0:  # nothing to generate (TokenGenerator's answer)
                            outbox.append((job, ("done", GenStats(prompt_tokens=len(job.req.prompt_ids),
                                                                  finish_reason="length"))))
                        elif (len(admissions) < self.prompt_concurrency
                              and len(active) + len(admissions) < self.decode_concurrency):
                            admissions.append((next_rid, job))
                            next_rid = (next_rid + 1) % (1 << 30)
                        else:
                            keep.append(job)
                    backlog[:] = keep
                if stopping:
                    kind = KIND_SHUTDOWN
                elif active or admissions or removals or outbox:
                    kind = KIND_STEP
                else:  # nothing to run: wait for a request, then (other ranks) let them sleep
                    if group.single or channel is not None:  # no follower spins in a collective meanwhile
                        if not take(timeout=0.2):
                            self.stopping.set()
                        continue
                    if idle:
                        wait = idle_until - time.monotonic()
                        if wait > 0 and not take(timeout=wait):
                            self.stopping.set()
                        if backlog or self.stopping.is_set() or time.monotonic() < idle_until:
                            continue
                    elif not take(timeout=IDLE_AFTER_S):
                        self.stopping.set()
                        continue
                    elif backlog:
                        continue
                    kind = KIND_IDLE
                if stopping:
                    for a in active.values():
                        outbox.append((a.job, ("error", SHUTDOWN_MESSAGE, 503)))
                    for job in backlog:
                        outbox.append((job, ("error", SHUTDOWN_MESSAGE, 503)))
                    active.clear()
                    backlog.clear()
                payload = encode_changes(removals, [(rid, job.req) for rid, job in admissions]) \
                    if kind == KIND_STEP and (removals or admissions) else np.zeros(0, np.int32)
                idle_ms = int(IDLE_SLEEP_S * 1000) if kind == KIND_IDLE else 0
                self.busy_since = t_step = t_sync = time.monotonic()
                if kind == KIND_STEP:
                    self.times.rest += t_sync - t_rest  # detokenising, events, scheduling since the last step
                # Before step()'s next launch, so changes decided on the ids just read reach it (one step in flight);
                # over the host channel it does not wait for that step (an all_sum would, behind it on the stream).
                _, payload = sync_step(group, guard, [MAGIC, kind, len(payload), idle_ms], payload, channel)
                t_rest = time.monotonic()
                self.times.sync += t_rest - t_sync
                shutdown_sent = kind == KIND_SHUTDOWN
                for job, ev in outbox:  # the ids behind these events agree on every rank
                    job.events.put(ev)
                outbox.clear()
                if kind == KIND_SHUTDOWN:
                    return
                idle = kind == KIND_IDLE
                if idle:
                    self.busy_since = None
                    idle_until = time.monotonic() + IDLE_SLEEP_S
                    continue
                if len(payload):
                    removals_, admits_ = decode_changes(payload)
                    for rid in removals_:
                        eng.remove(rid)
                    removals.clear()
                    self.busy_since = None  # prefills: as long as their prompts (never judged stuck)
                    eng.add_many([(rid, req.prompt_ids, req.sampling, req.max_tokens) for rid, req in admits_])
                    self.times.admitted(time.monotonic() - t_rest, [len(req.prompt_ids) for _, req in admits_])
                    for (rid, req), (_, job) in zip(admits_, admissions):
                        if req.logprobs is not None:
                            eng.want[rid] = req.logprobs
                        ids = req.prompt_ids
                        active[rid] = Active(job, StreamDecoder(self.tok, context=list(ids)[-4:]),
                                             StopStrings(req.stop), GenStats(prompt_tokens=len(ids)),
                                             set() if req.ignore_eos else set(self.tok.eos_ids))
                if admissions:
                    t_step = time.monotonic()
                self.busy_since = t_step
                t0 = time.monotonic()
                out = eng.step()
                t_rest = time.monotonic()
                self.busy_since = None
                self.step_s = 0.9 * self.step_s + 0.1 * (t_rest - t_step)
                self.times.stepped(t_rest - t0, len(out))
                for rid, tok in out.items():
                    guard._record(tok)
                    a = active.get(rid)
                    if a is None:  # pragma: no cover - every row belongs to an active request
                        continue
                    st = a.stats
                    st.generated += 1
                    st.tokens.append(tok)
                    if tok in a.eos:
                        finish(rid, a, "eos")
                        continue
                    if a.job.req.logprobs is not None:
                        outbox.append((a.job, ("token", tok, eng.logprobs.get(rid))))
                    text = a.stopper.feed(a.decoder.add(tok))
                    if text:
                        outbox.append((a.job, ("text", text)))
                    if a.stopper.stopped is not None:
                        st.stop = a.stopper.stopped
                        finish(rid, a, "stop")
                    elif st.generated >= a.job.req.max_tokens:
                        finish(rid, a, "length")
        except RanksDiverged as e:  # raised on every rank: they have all left
            self.busy_since = None
            self.fail_all(str(e), 500)
            raise
        except BaseException as e:  # the server goes down; every waiting client still gets an answer
            self.busy_since = None
            self.fail_all(f"generation failed: {type(e).__name__}: {e}", 500)
            print(f"serve: rank 0 failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            raise
        else:
            if not shutdown_sent:  # pragma: no cover - the loop returns after sending it
                sync_step(group, guard, [MAGIC, KIND_SHUTDOWN, 0, 0], np.zeros(0, np.int32), channel)
        finally:
            if self.times.steps:
                print(f"serve: {self.times}", file=sys.stderr, flush=True)
            if channel is not None:
                channel.close()
            self.fail_all(SHUTDOWN_MESSAGE, 503)  # whatever is still queued: answered, not dropped


class Job:
    def __init__(self, req: GenRequest):
        self.req = req
        self.cancelled = threading.Event()  # its client went away: the row is freed
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
                        eos_ids=() if req.ignore_eos else None, prefill_step=prefill_step, group=group,
                        logprobs=req.logprobs, on_token=on_token)
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
    channel = HostChannel.open(group)  # the same call as rank 0's prepare(), at the same point
    while True:
        req = exchange(group, channel=channel)
        if req is None:
            print(f"serve: rank {group.rank()} stopped", file=sys.stderr, flush=True)
            return
        try:
            run_generation(model, tok, group, prefill_step, req)
        except Cancelled:  # rank 0 is stopping: its shutdown message comes next
            pass
        except UserError:  # refused on every rank alike (e.g. logprobs for a model with its own loop); rank 0 answers
            pass


# Batched serving ---------------------------------------------------------------
#
# Rank 0's main thread is the scheduler; every rank runs `batch_loop`, the same
# BatchEngine calls in the same order. One iteration:
#
# 1. one exchange over the host channel (collectives.HostChannel, a TCP star
#    set up once): every rank sends rank 0 its rank-agreement row (count,
#    checksum, last id of every id generated so far), rank 0 sends back every
#    row plus its control header (magic, kind, payload length, idle time) and,
#    when the batch changes, the payload (the rows to remove, then each
#    admitted request: its row id and the hand-off encoding of `encode`:
#    prompt ids and bit-copied sampling values). So the ids of the last step
#    are checked on every rank at every step; rank 0 sends the last step's
#    text to the clients only after that verdict. Nothing of it is queued on
#    the device, so it never waits for the step in flight.
# 2. without the channel (a rank could not reach rank 0 over TCP): the same
#    header and rows as one all_sum, and the payload as a broadcast when it is
#    not empty; each waits behind the step in flight (one stream);
# 3. removals, admissions (up to --prompt-concurrency, prefilled together by
#    BatchEngine.add_many),
#    then one BatchEngine.step for every row (up to --decode-concurrency):
#    pipelined, it launches the next step before it reads this one, so a row
#    removed at 1. was fed once more; that step's id for it is never read.
#
# Rank 0 detokenises each row (StreamDecoder, StopStrings, as
# engine.generate_text) and decides when it ends (EOS, max_tokens, a stop
# string, its client gone); the removal travels in the next step's payload, so
# the other ranks never decide anything themselves.
#
# Idle: with the channel, a follower waits for rank 0's next frame in recv
# (asleep) and rank 0 simply waits for a request. Without it: with no row and
# nothing queued for IDLE_AFTER_S (0.5 s), rank 0 sends an IDLE
# note; the other ranks sleep IDLE_SLEEP_S - IDLE_MARGIN_S before they enter
# the next collective (where MPI and ring spin), rank 0 enters it IDLE_SLEEP_S
# after the note, or at once when a request comes (which then waits at most
# IDLE_SLEEP_S for them). So an idle job spins about IDLE_MARGIN_S per
# IDLE_SLEEP_S on each follower, and a first request after a quiet spell
# starts at most IDLE_SLEEP_S late (0.3 s: under a typical prompt's prefill
# plus a few tokens on a cluster; 0.02 s of margin absorbs a loaded host's
# timer slack).



def parse_size(text: str, flag: str) -> int:
    """mlx-lm's sizes: a number with an optional M, MB, G or GB (decimal units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([MG]B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"{flag} must be a byte count like 500M or 2GB, got {text!r}")
    unit = {"": 1, "M": 10**6, "G": 10**9}[(m.group(2) or "")[:1].upper()]
    n = int(float(m.group(1)) * unit)
    if n < 1:
        raise UserError(f"{flag} must be >= 1 byte, got {text!r}")
    return n


def batchable(model) -> bool:
    """Models with their own generation loop (generate_ids) are served one
    request at a time; every other model through BatchEngine."""
    return not callable(getattr(model, "generate_ids", None))


def encode_changes(removals: list, admissions: list) -> np.ndarray:
    """[n_remove, rid..., n_admit, (rid, header..., payload length, payload...)...]"""
    parts = [np.array([len(removals), *removals], np.int32), np.array([len(admissions)], np.int32)]
    for rid, req in admissions:
        header, payload = encode(req)
        parts += [np.array([rid], np.int32), header, np.array([len(payload)], np.int32), payload]
    return np.concatenate(parts)


def decode_changes(payload: np.ndarray) -> tuple[list, list]:
    i = 0
    n = int(payload[i])
    removals = [int(x) for x in payload[i + 1 : i + 1 + n]]
    i += 1 + n
    admissions = []
    for _ in range(int(payload[i])):
        rid = int(payload[i + 1])
        header = payload[i + 2 : i + 2 + HEADER_INTS]
        m = int(payload[i + 2 + HEADER_INTS])
        start = i + 3 + HEADER_INTS
        admissions.append((rid, decode(header, payload[start : start + m])))
        i = start + m - 1
    return removals, admissions


def sync_step(group: Group, guard, control=None, payload=None, channel=None) -> tuple[np.ndarray, np.ndarray]:
    """Every rank: rank 0's control header and payload (the others pass None)
    and the rank-agreement verdict on every id generated so far. Over the host
    channel when there is one (one round trip, nothing queued on the device);
    otherwise one all_sum, plus a broadcast of the payload when it is not empty."""
    import mlx.core as mx

    n = group.size()
    row = np.array([guard.count, guard.checksum, guard.last], np.int32)
    if channel is not None:
        msg = np.concatenate([np.asarray(control, np.int32), np.asarray(payload, np.int32)]) \
            if group.is_root else None
        rows, msg = channel.exchange(row, msg)
        guard._verdict(rows)  # RanksDiverged on every rank alike
        vec, payload = msg[:CONTROL_INTS], msg[CONTROL_INTS:]
    else:
        vec = np.zeros(CONTROL_INTS + 3 * n, np.int32)
        if group.is_root:
            vec[:CONTROL_INTS] = control
        r = CONTROL_INTS + 3 * group.rank()
        vec[r : r + 3] = row
        if not group.single:
            vec = np.array(group.all_sum(mx.array(vec)))
            guard._verdict(vec[CONTROL_INTS:].reshape(n, 3))
        m = int(vec[2]) if int(vec[0]) == MAGIC else 0
        if not group.single:  # rank 0's payload, when it has one, as a broadcast (at np 1 it is already here)
            payload = group.broadcast(payload, (m,)) if m else np.zeros(0, np.int32)
    if int(vec[0]) != MAGIC:
        raise RuntimeError(f"serve: bad step header (magic {int(vec[0]):#x})")
    return vec[:CONTROL_INTS], payload


def make_engine(model, prefill_step, cache_size: int, cache_bytes: int | None, logprobs: bool = False):
    from .batch import BatchEngine
    from .prompt_cache import DEFAULT_MAX_BYTES, PromptCache

    pc = PromptCache(cache_size, DEFAULT_MAX_BYTES if cache_bytes is None else cache_bytes) if cache_size else None
    cls = _logprob_batch_class() if logprobs else BatchEngine
    return cls(model, prefill_step, prompt_cache=pc)


@functools.lru_cache(maxsize=None)
def _logprob_batch_class():
    from .batch import BatchEngine

    class _LogprobBatch(BatchEngine):
        """Rank 0's BatchEngine: also each requesting row's logprobs (no
        collective: the other ranks need not compute them), with
        TokenGenerator's definition (log-softmax after the repetition penalty,
        before temperature and filters)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.want: dict = {}  # rid -> k
            self.logprobs: dict = {}  # rid -> (logprob, [(id, logprob), ...]) of the last step

        def step_extras(self, logits: list, ids: list, pending: list) -> dict:
            import mlx.core as mx

            from .sampling import apply_repetition_penalty

            lazy = {}
            for r, x, tok, prev in zip(self.rows, logits, ids, pending):
                k = self.want.get(r.rid)
                if k is None:
                    continue
                p = r.sampler.params
                # `prev`: the row's id still unread when this step was launched (pipelined)
                y = apply_repetition_penalty(x.reshape(-1).astype(mx.float32), r.context, p.repetition_penalty,
                                             p.repetition_context_size, prev)
                lp = y - mx.logsumexp(y, axis=-1, keepdims=True)
                k = min(k, lp.shape[-1])
                top = mx.argpartition(-lp, kth=k - 1)[:k] if k else None
                lazy[r.rid] = (mx.take(lp, tok.reshape(1)),) + (() if top is None else (top, mx.take(lp, top)))
            return lazy

        def collect(self) -> dict:
            out = super().collect()
            self.logprobs = {}
            for rid, parts in (self.extras or {}).items():
                if rid not in out:  # a removed row's unread step
                    continue
                entries = []
                if len(parts) > 1:
                    top, vals = np.array(parts[1]), np.array(parts[2])
                    entries = [(int(top[i]), float(vals[i])) for i in np.argsort(-vals, kind="stable")]
                self.logprobs[rid] = (float(np.array(parts[0])[0]), entries)
            return out

        def remove(self, rid) -> None:
            self.want.pop(rid, None)
            super().remove(rid)

    return _LogprobBatch


@dataclass
class StepTimes:
    """Rank 0's batched loop, summed while rows run (idle waits excluded):
    BatchEngine.step (launch the next step, read this one: the device's time
    shows here), admissions (removals and add_many: the prompts' prefill),
    the per-step sync with the other ranks, and the rest (detokenising, stop
    strings, events, scheduling)."""

    steps: int = 0
    tokens: int = 0
    step: float = 0.0
    admit: float = 0.0
    groups: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    sync: float = 0.0
    rest: float = 0.0

    def stepped(self, seconds: float, rows: int) -> None:
        self.steps += 1
        self.tokens += rows
        self.step += seconds

    def admitted(self, seconds: float, lengths: list) -> None:
        self.admit += seconds
        self.groups += 1
        self.prompts += len(lengths)
        self.prompt_tokens += sum(lengths)

    def __str__(self) -> str:
        return (f"{self.steps} steps, {self.tokens} tokens ({self.tokens / max(self.steps, 1):.1f} rows a step): "
                f"steps {self.step:.2f} s, admissions {self.admit:.2f} s ({self.prompts} prompts, "
                f"{self.prompt_tokens} tokens, {self.groups} groups), sync {self.sync:.2f} s, rest {self.rest:.2f} s")


@dataclass
class Active:
    """Rank 0's view of one row: its job, detokeniser, stop strings, counts."""

    job: "Job"
    decoder: object
    stopper: object
    stats: object
    eos: set


def warm_up(eng, rows: int, group: Group) -> None:
    """Every rank: compile the batch step for every capacity up to `rows`
    (BatchEngine.warmup); rank 0 says how long it took."""
    t = time.monotonic()
    done = eng.warmup(rows)
    if group.is_root:
        print(f"serve: batch steps ready for 1-{done[-1][0]} rows in {time.monotonic() - t:.1f} s "
              f"({', '.join(f'{c}: {s:.1f}' for c, s in done)})", file=sys.stderr, flush=True)


def follower_batch_loop(model, group: Group, prefill_step, cache_size: int, cache_bytes: int | None,
                        warmup_rows: int = 0) -> None:
    """Ranks other than 0 (batched models): the same engine calls as rank 0,
    in the same order, until the shutdown message."""
    from .engine import RankAgreement

    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides; its shutdown message ends this loop
        try:
            signal.signal(sig, lambda *_: None)
        except ValueError:  # pragma: no cover - not the main thread
            pass
    eng = make_engine(model, prefill_step, cache_size, cache_bytes)
    guard = RankAgreement(group, every=0)
    channel = HostChannel.open(group)  # the same call as rank 0's, at the same point
    if warmup_rows:
        warm_up(eng, warmup_rows, group)
    while True:
        control, payload = sync_step(group, guard, channel=channel)
        _, kind, n, idle_ms = (int(x) for x in control)
        if kind == KIND_SHUTDOWN:
            print(f"serve: rank {group.rank()} stopped", file=sys.stderr, flush=True)
            return
        if kind == KIND_IDLE:
            time.sleep(max(idle_ms / 1000 - IDLE_MARGIN_S, 0))
            continue
        if n:
            removals, admissions = decode_changes(payload)
            for rid in removals:
                eng.remove(rid)
            eng.add_many([(rid, req.prompt_ids, req.sampling, req.max_tokens) for rid, req in admissions])
        for tok in eng.step().values():
            guard._record(tok)


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
                try:
                    if stream:
                        self._stream(job, rid, chat, body)
                    else:
                        self._whole(job, rid, chat, req)
                finally:
                    svc.closed(job)

        _polled = 0.0

        def _client_gone(self) -> bool:
            """The client closed its connection (readable with nothing to read)."""
            try:
                r, _, _ = select.select([self.connection], [], [], 0)
                return bool(r) and self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except (OSError, ValueError):
                return True

        def _next_event(self, job):
            """The job's next event; None once its client is gone (polled every
            POLL_S while waiting): the scheduler then frees its row."""
            while True:
                now = time.monotonic()
                if now - self._polled >= POLL_S:  # also while events flow (a non-stream answer writes nothing)
                    self._polled = now
                    if self._client_gone():
                        job.cancelled.set()
                        self.close_connection = True
                        return None
                try:
                    return job.events.get(timeout=POLL_S)
                except queue.Empty:
                    pass

        def _whole(self, job, rid, chat, req):
            parts, entries = [], []
            while True:
                ev = self._next_event(job)
                if ev is None:
                    return
                kind, *v = ev
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
                except OSError:  # client went away: its row is freed at the next step
                    alive = False
                    job.cancelled.set()

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
            while alive:
                ev = self._next_event(job)
                if ev is None:
                    return
                kind, *v = ev
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
    request_queue_size = 128  # listen backlog (socketserver's 5 resets clients that connect at once)

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.connections = 0
        self.closed_all = threading.Condition()

    def process_request(self, request, client_address):
        with self.closed_all:
            self.connections += 1
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        try:
            super().shutdown_request(request)
        finally:
            with self.closed_all:
                self.connections -= 1
                self.closed_all.notify_all()

    def wait_closed(self, timeout: float) -> bool:
        """Until every connection is closed by its handler (a process that
        exits first leaves the kernel to close it, which can reset it)."""
        with self.closed_all:
            return self.closed_all.wait_for(lambda: self.connections <= 0, timeout)


# MLX CUDA's caches (CUDA graphs, cuDNN SDPA and conv plans) are LRUs whose
# "Cache thrashing" check throws once a process has ever missed more than twice
# their capacity (a lifetime count, never reset): a long-lived server meets new
# batch sizes and prompt shapes for as long as it runs, and the throw would end
# it with every open request. Off by default for serve (the caches stay LRUs).
# The CUDA graph LRU (400 graphs of <= 20 kernels) holds about five batch sizes'
# steps of a 48-layer model: 2000 instead, since on one H200 host serve
# --warmup's steady decode was 30-40% slower at 400 and not at 2000 (on a
# second host it was slower at both; without --warmup no difference either
# way: docs/benchmarks.md). A value the user sets wins. MLX reads them at its
# first GPU evaluation (set after one they are ignored; measured), so the serve
# command sets them before anything else.
LONG_LIVED_ENV = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0", "MLX_CUDA_GRAPH_CACHE_SIZE": "2000"}


def long_lived_env() -> dict:
    """Set serve's MLX environment defaults in this process (every rank calls
    it; the launcher's ranks also inherit them); returns what is now in effect."""
    for k, v in LONG_LIVED_ENV.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in LONG_LIVED_ENV}


def listen(host: str, port: int) -> "_Server":
    """Rank 0, before the model loads: bind the port (a port in use fails in
    seconds, before any rank waits on rank 0). Connections queue in the
    backlog until `serve` runs."""
    try:
        return _Server((host, port), BaseHTTPRequestHandler)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(svc: Service, httpd: "_Server") -> None:
    """Rank 0: serve `listen`'s socket in a thread, process jobs here until SIGINT/SIGTERM."""
    httpd.RequestHandlerClass = _make_handler(svc)
    saved = {}

    def on_signal(signum, _frame):
        svc.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        saved[sig] = signal.signal(sig, on_signal)
    # The main thread may be blocked in a collective (C code) when another
    # rank has died: Python handlers then never run. The C-level handler still
    # writes the signal's number to the wakeup fd; this thread reads it, asks
    # the loop to stop, and if the loop has not stopped within STUCK_S, fails
    # every open request and ends the process.
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    saved_fd = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    threading.Thread(target=_watch_signals, args=(svc, rfd, httpd), daemon=True).start()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    try:
        svc.prepare()  # the engine, the host channel, the warm-up: before any request is read
        thread.start()
        h, p = httpd.server_address[:2]
        if svc.plain_chat:
            print(f"serve: {svc.model_id} has no chat template: chat requests are rendered as plain "
                  "'USER: ... ASSISTANT:' text (as mlx-lm's server)", file=sys.stderr, flush=True)
        print(f"serve: {svc.model_id} on http://{h}:{p}/v1 (np {svc.group.size()})",
              file=sys.stderr, flush=True)
        svc.loop()
    finally:
        svc.loop_done.set()  # (loop sets it too; here also when prepare failed)
        # every request was answered (or errored) by the loop; let the
        # handlers finish writing before the process (and its daemon threads) ends
        svc.wait_answered()
        httpd.wait_closed(1.0)
        if thread.is_alive():  # shutdown() waits for serve_forever, which never ran when prepare failed
            httpd.shutdown()
        httpd.server_close()
        signal.set_wakeup_fd(saved_fd)
        for sig, old in saved.items():
            signal.signal(sig, old)
        print("serve: stopped", file=sys.stderr, flush=True)


def _watch_signals(svc: Service, rfd: int, httpd: "_Server") -> None:
    """Rank 0: see serve(). A signal's byte arrives here even while the main
    thread sits in C code."""
    while True:
        try:
            data = os.read(rfd, 64)
        except OSError:  # pragma: no cover
            return
        if not data:
            return
        if not any(b in (signal.SIGINT, signal.SIGTERM) for b in data):
            continue
        busy = svc.busy_since  # (the sequential loop of unbatched models never sets it)
        svc.stop()
        now = time.monotonic()
        stuck = busy is not None and now - busy > max(STUCK_S, STUCK_STEPS * svc.step_s)
        while not stuck and not svc.loop_done.wait(0.01):
            busy = svc.busy_since
            stuck = busy is not None and time.monotonic() - max(busy, now) > max(STUCK_LATE_S,
                                                                                 10 * STUCK_STEPS * svc.step_s)
        if not stuck:
            return
        n = svc.fail_all(f"{SHUTDOWN_MESSAGE}: the ranks did not stop (a rank has failed or is not responding)",
                         503)
        if svc.loop_done.wait(STUCK_LATE_S):  # only slow after all: the main thread ends the job as usual
            return
        svc.wait_answered(1.0)
        httpd.wait_closed(0.1)
        print(f"serve: rank 0 stopped without the other ranks ({n} open request(s) answered with an error)",
              file=sys.stderr, flush=True)
        os._exit(1)
