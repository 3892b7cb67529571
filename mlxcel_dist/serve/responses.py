"""OpenAI's response objects: whole answers, stream chunks, usage, errors, and
logprobs in OpenAI's two forms (chat's `content[]`, completions' lists).
Pure functions of a :class:`openai_api.Parsed` and what the scheduler sent."""

from __future__ import annotations

import math
import re

from . import reasoning, tools
from .openai_api import Parsed
from .openai_schema import ApiError


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
    for t, got in entries:  # got None: an echoed prompt's first token (nothing predicts it)
        text = pieces(t)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(None if got is None else _lp(got[0]))
        out["top_logprobs"].append(None if got is None else {pieces(i)[0]: _lp(v) for i, v in got[1]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object. `completion_tokens` counts what the client was
    shown: the scheduler passes it without the EOS token."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(p: Parsed, rid: str, created: int, chunk: bool) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if p.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": p.model}


def whole_response(p: Parsed, rid: str, created: int, choices: list[dict], prompt_tokens: int,
                   completion_tokens: int) -> dict:
    """The non-streamed answer: chat.completion or text_completion, its
    `choices` from :func:`whole_choice`; usage counts the prompt once (the
    choices share it) and every choice's tokens."""
    return {**_head(p, rid, created, False), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def echo_entries(ev) -> list:
    """(id, (logprob, top) or None) per token of an echoed prompt (scheduler.Prompt)."""
    return list(zip(ev.ids, ev.logprobs))


def whole_choice(p: Parsed, index: int, text: str, finish_reason: str, entries, pieces: TokenPieces) -> dict:
    """One choice of a non-streamed answer. `finish_reason`: the engine's
    (eos / stop / length); `entries`: (id, (logprob, top)) per shown token.
    With a reasoning form (`p.reasoning`) the thinking goes to
    `reasoning_content` (and mlx-lm's `reasoning`); with tools
    (`p.tool_format`) calls in the rest become `tool_calls`."""
    finish = FINISH.get(finish_reason, "stop")
    want = p.req.logprobs is not None
    if p.chat:
        thought = None
        if p.reasoning is not None:
            thought, text = reasoning.split(p.reasoning, text, p.thinking)
        message = {"role": "assistant", "content": text}
        if p.tool_format is not None:
            content, calls = tools.parse(p.tool_format, text, p.tools, p.forced)
            if calls or p.forced:
                message = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
                finish = "tool_calls" if finish == "stop" else finish
        if thought:
            message["reasoning_content"] = message["reasoning"] = thought
        return {"index": index, "message": message,
                "logprobs": chat_logprobs(pieces, entries) if want else None, "finish_reason": finish}
    return {"index": index, "text": text,
            "logprobs": completion_logprobs(pieces, entries, 0)[0] if want else None, "finish_reason": finish}


def stream_chunk(p: Parsed, rid: str, created: int, delta_or_text, finish: str | None = None,
                 logprobs: dict | None = None, index: int = 0) -> dict:
    """One SSE chunk of choice `index`: chat's `delta` (a dict) or
    completions' `text`; with include_usage each carries `"usage": null`, as
    OpenAI's do."""
    choice = {"index": index, "delta" if p.chat else "text": delta_or_text, "logprobs": logprobs,
              "finish_reason": None if finish is None else FINISH.get(finish, finish)}
    out = {**_head(p, rid, created, True), "choices": [choice]}
    if p.include_usage:
        out["usage"] = None
    return out


def tool_call_deltas(calls: list) -> list[dict]:
    """OpenAI's streamed form of each call: its id, type and name with empty
    arguments first, then the arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return out


def usage_chunk(p: Parsed, rid: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's last chunk with include_usage (after the finish chunk): no choices, the usage."""
    return {**_head(p, rid, created, True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


_STATUS_CODES = {400: "invalid_request", 404: "not_found", 429: "rate_limit_exceeded", 500: "internal_error",
                 503: "service_unavailable", 504: "timeout"}


def stream_error(message: str, status: int) -> dict:
    """The error event of a stream already answered 200: code a string, never the status int."""
    code = _STATUS_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")
    return ApiError(message, status, code=code).body()
