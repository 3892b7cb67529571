"""What crosses from rank 0 to the other ranks, and its int32 encoding.

Every value a request hands to the engine travels here: a value the encoding
cannot hold is refused at parse time (`WIRE_LIMITS`, read by the OpenAI
layer), never found out while packing a step that other requests share.

A request (:func:`encode_request`):

1. a fixed-size int32 header: magic, kind (job), prompt length, stop-strings
   byte count, max_tokens, top_k, repetition context size, the logprobs
   setting (0 = off, k + 1 = the drawn token's and the top k), ignore_eos
   (0 / 1), the logit-bias and stop-token-id counts, the grammar's byte
   count (0: unconstrained), speculative (1, 0: the request opted out of
   drafts), the seed in four 16-bit
   parts, and the float64 sampling values (temperature, top_p, min_p,
   repetition, presence and frequency penalties) bit-copied as int32 pairs,
   so every rank samples with the very same values rank 0 does;
2. an int32 payload: the prompt ids, the UTF-8 bytes of the stop strings
   (JSON list), the logit bias's token ids then its float32 values
   bit-copied, the stop token ids, the grammar (mlxcel_dist.grammar's
   serialized text, UTF-8, four bytes an int32), so every rank builds the
   same matcher.

A step (:class:`Step`, :func:`encode_step`): a control header (magic, kind,
payload length, idle milliseconds), then for a STEP with changes the
removals and the admissions ([n_remove, rid..., n_admit, (rid, request
header..., payload length, payload...)...]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..sampling import SEED_LIMIT, SamplingParams

MAGIC = 0x4D4C5853  # "MLXS"
KIND_JOB = 1
KIND_SHUTDOWN = 2
KIND_STEP = 3
KIND_IDLE = 4
HEADER_INTS = 13 + 4 + 2 * 6  # ints, seed parts, float64 pairs
CONTROL_INTS = 4  # magic, kind, payload length, idle milliseconds
INT32_MAX = 2**31 - 1
RID_LIMIT = 1 << 30  # row ids wrap below this

# The ranges the encoding holds, per request field (inclusive); the OpenAI
# layer refuses anything outside with a 400 naming the field.
WIRE_LIMITS = {
    "max_tokens": (0, INT32_MAX),
    "top_k": (0, INT32_MAX),
    "repetition_context_size": (0, INT32_MAX),
    "logprobs": (0, INT32_MAX - 1),
    "seed": (0, SEED_LIMIT - 1),
    "prompt_tokens": (1, INT32_MAX),
    "logit_bias": (0, 1024),  # entries
    "stop_token_ids": (0, 1024),  # entries
    "grammar": (0, 1 << 24),  # bytes of the serialized grammar
}


@dataclass
class GenRequest:
    """What every rank needs to run one generation."""

    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams
    stop: list = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: each token's logprob and the k most likely
    ignore_eos: bool = False  # vLLM's extra field: EOS is an ordinary token (runs to max_tokens or a stop string)
    stop_ids: list = field(default_factory=list)  # vLLM's stop_token_ids: generation ends at one, as at EOS
    grammar: str | None = None  # constrained decoding (mlxcel_dist.grammar's text): response_format, forced tools
    speculative: bool = True  # False: the request opted out of drafts (serve --draft-model / --prompt-lookup)


def check_wire(req: GenRequest) -> None:
    """ValueError naming the first field the encoding cannot hold."""
    s = req.sampling
    values = {"max_tokens": req.max_tokens, "top_k": s.top_k, "repetition_context_size": s.repetition_context_size,
              "seed": s.seed, "prompt_tokens": len(req.prompt_ids)}
    if req.logprobs is not None:
        values["logprobs"] = req.logprobs
    for name, v in values.items():
        lo, hi = WIRE_LIMITS[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}")
    for name, n in (("logit_bias", len(s.logit_bias)), ("stop_token_ids", len(req.stop_ids)),
                    ("grammar", len(req.grammar.encode("utf-8")) if req.grammar else 0)):
        lo, hi = WIRE_LIMITS[name]
        if not lo <= n <= hi:
            raise ValueError(f"'{name}' may hold at most {hi} entries, got {n}")
    for name, ids in (("prompt", req.prompt_ids), ("logit_bias", [t for t, _ in s.logit_bias]),
                      ("stop_token_ids", req.stop_ids)):
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in ids):
            raise ValueError(f"the {name}'s token ids must be integers in [0, 2^31)" if name == "prompt"
                             else f"'{name}' token ids must be integers in [0, 2^31)")


def encode_request(req: GenRequest) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) int32 arrays of one request."""
    check_wire(req)
    header = np.zeros(HEADER_INTS, np.int32)
    header[0] = MAGIC
    stop_bytes = np.frombuffer(json.dumps(req.stop).encode("utf-8"), np.uint8).astype(np.int32)
    grammar = (req.grammar or "").encode("utf-8")
    s = req.sampling
    header[1:13] = [KIND_JOB, len(req.prompt_ids), len(stop_bytes), req.max_tokens, s.top_k,
                    s.repetition_context_size, 0 if req.logprobs is None else req.logprobs + 1, int(req.ignore_eos),
                    len(s.logit_bias), len(req.stop_ids), len(grammar), int(req.speculative)]
    header[13:17] = [(s.seed >> (16 * i)) & 0xFFFF for i in range(4)]
    header[17:29] = np.array([s.temp, s.top_p, s.min_p, s.repetition_penalty, s.presence_penalty,
                              s.frequency_penalty], np.float64).view(np.int32)
    bias_ids = np.array([t for t, _ in s.logit_bias], np.int32)
    bias_bits = np.array([b for _, b in s.logit_bias], np.float32).view(np.int32)
    grammar_ints = np.frombuffer(grammar.ljust(-(-len(grammar) // 4) * 4, b"\0"), np.int32)
    payload = np.concatenate([np.asarray(req.prompt_ids, np.int32), stop_bytes, bias_ids, bias_bits,
                              np.asarray(req.stop_ids, np.int32), grammar_ints])
    return header, payload


def decode_request(header: np.ndarray, payload: np.ndarray) -> GenRequest:
    if int(header[0]) != MAGIC or int(header[1]) != KIND_JOB:
        raise RuntimeError(f"serve: bad request header (magic {int(header[0]):#x}, kind {int(header[1])})")
    n_ids, n_stop, max_tokens, top_k, rep_ctx, lp, ignore_eos, n_bias, n_stop_ids, n_grammar, speculative = (
        int(x) for x in header[2:13])
    seed = sum(int(header[13 + i]) << (16 * i) for i in range(4))
    temp, top_p, min_p, rep, presence, frequency = (
        float(x) for x in np.ascontiguousarray(header[17:29]).view(np.float64))
    stop = json.loads(payload[n_ids:n_ids + n_stop].astype(np.uint8).tobytes().decode("utf-8"))
    at = n_ids + n_stop
    bias_ids = payload[at:at + n_bias].tolist()
    bias = np.ascontiguousarray(payload[at + n_bias:at + 2 * n_bias]).view(np.float32).tolist()
    stop_ids = payload[at + 2 * n_bias:at + 2 * n_bias + n_stop_ids].tolist()
    at += 2 * n_bias + n_stop_ids
    grammar = (np.ascontiguousarray(payload[at:at + -(-n_grammar // 4)]).view(np.uint8)[:n_grammar].tobytes()
               .decode("utf-8") if n_grammar else None)
    sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
                              repetition_context_size=rep_ctx, seed=seed, presence_penalty=presence,
                              frequency_penalty=frequency, logit_bias=tuple(zip(bias_ids, bias)))
    return GenRequest(payload[:n_ids].tolist(), max_tokens, sampling, stop, None if lp == 0 else lp - 1,
                      bool(ignore_eos), stop_ids, grammar, bool(speculative))


@dataclass
class Step:
    """One step of every rank's engine, decided by rank 0's scheduler:
    `kind` STEP (remove, then admit, then one engine step), IDLE (nothing to
    run: sleep `idle_ms`) or SHUTDOWN."""

    kind: int = KIND_STEP
    removals: list = field(default_factory=list)  # row ids
    admissions: list = field(default_factory=list)  # (row id, GenRequest)
    idle_ms: int = 0

    @property
    def changes(self) -> bool:
        return bool(self.removals or self.admissions)


def encode_step(step: Step) -> np.ndarray:
    """The control header, then (a STEP with changes) its payload."""
    if step.kind == KIND_STEP and step.changes:
        parts = [np.array([len(step.removals), *step.removals], np.int32),
                 np.array([len(step.admissions)], np.int32)]
        for rid, req in step.admissions:
            header, payload = encode_request(req)
            parts += [np.array([rid], np.int32), header, np.array([len(payload)], np.int32), payload]
        payload = np.concatenate(parts)
    else:
        payload = np.zeros(0, np.int32)
    control = np.array([MAGIC, step.kind, len(payload), step.idle_ms], np.int32)
    return np.concatenate([control, payload])


def decode_step(msg: np.ndarray) -> Step:
    if len(msg) < CONTROL_INTS or int(msg[0]) != MAGIC:
        raise RuntimeError(f"serve: bad step header (magic {int(msg[0]) if len(msg) else 0:#x})")
    _, kind, n, idle_ms = (int(x) for x in msg[:CONTROL_INTS])
    step = Step(kind, idle_ms=idle_ms)
    payload = msg[CONTROL_INTS:CONTROL_INTS + n]
    if not n:
        return step
    i = 0
    k = int(payload[i])
    step.removals = [int(x) for x in payload[i + 1 : i + 1 + k]]
    i += 1 + k
    for _ in range(int(payload[i])):
        rid = int(payload[i + 1])
        header = payload[i + 2 : i + 2 + HEADER_INTS]
        m = int(payload[i + 2 + HEADER_INTS])
        start = i + 3 + HEADER_INTS
        step.admissions.append((rid, decode_request(header, payload[start : start + m])))
        i = start + m - 1
    return step
