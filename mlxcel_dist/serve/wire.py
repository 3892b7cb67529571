"""What crosses from rank 0 to the other ranks, and its int32 encoding.

Every value a request hands to the engine travels here: a value the encoding
cannot hold is refused at parse time (`WIRE_LIMITS`, read by the OpenAI
layer), never found out while packing a step that other requests share.

A request (:func:`encode_request`) is encoded from its dataclass fields, so a
new field is one line of :class:`GenRequest`: the token-id lists (fields
marked `ids`) as int32 arrays, every other field (SamplingParams included)
as one JSON object, whose floats round-trip exactly (so every rank samples
with the very values rank 0 does) and whose grammar text is the matcher's
every rank builds. Its header: magic, kind (job), the JSON's byte count, each
id list's length.

A step (:class:`Step`, :func:`encode_step`): a control header (magic, kind,
payload length, then the step's other int fields in their order: a new one
is one line of `Step`), then for a STEP with changes the removals and the
admissions ([n_remove, rid..., n_admit, (rid, request header..., payload
length, payload...)...]).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from ..engine.sampling import SEED_LIMIT, SamplingParams

MAGIC = 0x4D4C5853  # "MLXS"
KIND_JOB = 1
KIND_SHUTDOWN = 2
KIND_STEP = 3
KIND_IDLE = 4
INT32_MAX = 2**31 - 1
RID_LIMIT = 1 << 30  # row ids wrap below this

# The ranges the encoding holds, per request field (inclusive); the OpenAI
# layer refuses anything outside with a 400 naming the field.
WIRE_LIMITS = {
    "max_tokens": (0, INT32_MAX),
    "top_k": (0, INT32_MAX),
    "repetition_context_size": (0, INT32_MAX),
    "logprobs": (0, INT32_MAX - 1),
    "echo": (0, INT32_MAX - 1),
    "seed": (0, SEED_LIMIT - 1),
    "prompt_tokens": (1, INT32_MAX),
    "logit_bias": (0, 1024),  # entries
    "stop_token_ids": (0, 1024),  # entries
    "grammar": (0, 1 << 24),  # bytes of the serialized grammar
}


def _ids():
    return field(default_factory=list, metadata={"ids": True})  # an int32 array on the wire


@dataclass
class GenRequest:
    """What every rank needs to run one generation."""

    prompt_ids: list = field(metadata={"ids": True})
    max_tokens: int
    sampling: SamplingParams
    stop: list = field(default_factory=list)
    logprobs: int | None = None  # None: off; k: each token's logprob and the k most likely
    ignore_eos: bool = False  # vLLM's extra field: EOS is an ordinary token (runs to max_tokens or a stop string)
    stop_ids: list = _ids()  # vLLM's stop_token_ids: generation ends at one, as at EOS
    grammar: str | None = None  # constrained decoding (mlxcel_dist.engine.grammar's text): response_format, forced tools
    speculative: bool = True  # False: the request opted out of drafts (serve --draft-model / --prompt-lookup)
    echo: int | None = None  # the prompt's logprobs too (OpenAI's echo), with the k most likely each


IDS = [f.name for f in fields(GenRequest) if f.metadata.get("ids")]


def check_wire(req: GenRequest) -> None:
    """ValueError naming the first field the encoding cannot hold."""
    s = req.sampling
    values = {"max_tokens": req.max_tokens, "top_k": s.top_k, "repetition_context_size": s.repetition_context_size,
              "seed": s.seed, "prompt_tokens": len(req.prompt_ids)}
    for name in ("logprobs", "echo"):
        if getattr(req, name) is not None:
            values[name] = getattr(req, name)
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
    rest = {f.name: getattr(req, f.name) for f in fields(GenRequest) if f.name not in IDS}
    rest["sampling"] = asdict(req.sampling)
    meta = json.dumps(rest, separators=(",", ":")).encode("utf-8")
    arrays = [np.asarray(getattr(req, name), np.int32).reshape(-1) for name in IDS]
    header = np.array([MAGIC, KIND_JOB, len(meta), *(len(x) for x in arrays)], np.int32)
    meta_ints = np.frombuffer(meta.ljust(-(-len(meta) // 4) * 4, b"\0"), np.int32)
    return header, np.concatenate([meta_ints, *arrays])


def decode_request(header: np.ndarray, payload: np.ndarray) -> GenRequest:
    if int(header[0]) != MAGIC or int(header[1]) != KIND_JOB:
        raise RuntimeError(f"serve: bad request header (magic {int(header[0]):#x}, kind {int(header[1])})")
    n = int(header[2])
    at = -(-n // 4)
    values = json.loads(np.ascontiguousarray(payload[:at]).view(np.uint8)[:n].tobytes().decode("utf-8"))
    sampling = values.pop("sampling")
    sampling["logit_bias"] = tuple(tuple(x) for x in sampling["logit_bias"])
    for name, k in zip(IDS, (int(x) for x in header[3:])):
        values[name] = payload[at : at + k].tolist()
        at += k
    return GenRequest(sampling=SamplingParams(**sampling), **values)


@dataclass
class Step:
    """One step of every rank's engine, decided by rank 0's scheduler:
    `kind` STEP (remove, then admit, then one engine step), IDLE (nothing to
    run: sleep `idle_ms`) or SHUTDOWN."""

    kind: int = KIND_STEP
    removals: list = field(default_factory=list)  # row ids
    admissions: list = field(default_factory=list)  # (row id, GenRequest)
    idle_ms: int = 0
    prefill_tokens: int = 0  # prompt tokens the step prefills beside its rows (serve.pacing; 0: the engine's budget)
    micro: int = 0  # the step's micro-batches (serve.pacing.MicroParts; 0: the engine's own)

    @property
    def changes(self) -> bool:
        return bool(self.removals or self.admissions)


SCALARS = tuple(f.name for f in fields(Step) if f.type == "int" and f.name != "kind")  # the header's after the length
CONTROL_INTS = 3 + len(SCALARS)  # magic, kind, payload length, SCALARS


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
    control = np.array([MAGIC, step.kind, len(payload), *(getattr(step, f) for f in SCALARS)], np.int32)
    return np.concatenate([control, payload])


def decode_step(msg: np.ndarray) -> Step:
    if len(msg) < CONTROL_INTS or int(msg[0]) != MAGIC:
        raise RuntimeError(f"serve: bad step header (magic {int(msg[0]) if len(msg) else 0:#x})")
    _, kind, n, *scalars = (int(x) for x in msg[:CONTROL_INTS])
    step = Step(kind, **dict(zip(SCALARS, scalars)))
    payload = msg[CONTROL_INTS:CONTROL_INTS + n]
    if not n:
        return step
    i = 0
    k = int(payload[i])
    step.removals = [int(x) for x in payload[i + 1 : i + 1 + k]]
    i += 1 + k
    for _ in range(int(payload[i])):
        rid = int(payload[i + 1])
        header = payload[i + 2 : i + 5 + len(IDS)]
        m = int(payload[i + 5 + len(IDS)])
        start = i + 6 + len(IDS)
        step.admissions.append((rid, decode_request(header, payload[start : start + m])))
        i = start + m - 1
    return step
