"""Constrained decoding: the grammars of structured output and forced tool
calls, and each row's matcher, through llguidance (the optional `grammar`
extra; docs/benchmarks-log.md "Grammar engines" says why this engine).

A grammar is built once where a request is parsed (rank 0: `json_schema`,
`json_object`, `tool_calls`), as llguidance's serialized grammar text, and
that text travels to every rank with the request (serve.wire). Every rank
then runs its own `Matcher` over the same ids: llguidance is deterministic,
so every rank computes the same mask from the same ids with no collective
(docs/benchmarks.md measures that against rank 0 shipping its masks).

A row's mask is a bitmask over the model's vocabulary (int32 words, bit i of
word i // 32 = token i allowed), unpacked on the device by
`sampling.allowed_from_bits` and applied before anything else touches the
logits (sampling.penalized). When the grammar is complete only EOS is
allowed, so a finished answer ends there.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import threading

import numpy as np

from .errors import UserError

INSTALL_HINT = "pip install 'mlxcel-dist[grammar]' (llguidance)"
# Compact JSON: no free whitespace between tokens, so a model cannot spend its
# max_tokens on blanks inside an answer (OpenAI's outputs are compact too).
JSON_OPTIONS = {"whitespace_flexible": False}


def available() -> bool:
    return importlib.util.find_spec("llguidance") is not None


def _ll():
    try:
        import llguidance
    except ImportError:
        raise UserError(f"constrained decoding needs llguidance: {INSTALL_HINT}") from None
    return llguidance


def _checked(grammar: str) -> str:
    """`grammar` if llguidance accepts it, else UserError with its message."""
    is_error, messages = _ll().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise UserError(f"the grammar is not usable: {messages[0] if messages else 'invalid'}")
    return grammar


def json_schema(schema) -> str:
    """The grammar of JSON documents valid under `schema` (a dict)."""
    if not isinstance(schema, dict):
        raise UserError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        grammar = _ll().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise UserError(f"the JSON schema is not usable: {e}") from None
    return _checked(grammar)


def json_object() -> str:
    """Any JSON object (OpenAI's `json_object` mode)."""
    return json_schema({"type": "object"})


def _call_schema(tool: dict, args_key: str) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


FORCED_FORMATS = ("hermes", "llama3_json", "mistral")  # the tool-call formats `tool_calls` writes grammars for


def tool_calls(fmt: str, tools: list, name: str | None = None, many: bool = False) -> str:
    """A grammar that forces tool calls in `fmt` (serve.tools.FORMATS): of
    function `name`, or (None: tool_choice `required`) of any of `tools`;
    one call, or with `many` one or more (OpenAI's parallel_tool_calls);
    each call's arguments valid under that function's parameter schema."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    schemas = [_call_schema(t, args_key) for t in chosen]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == "hermes":
        body = 'start: block ("\\n" block)*' if many else "start: block"
        lark = f'{body}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\n'
    elif fmt == "llama3_json":
        lark = 'start: call ("; " call)*\n' if many else "start: call\n"
    elif fmt == "mistral":
        lark = 'start: "[TOOL_CALLS]" "[" call (", " call)* "]"\n' if many else 'start: "[TOOL_CALLS]" "[" call "]"\n'
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    lark += "call: %json " + json.dumps({**call, "x-guidance": JSON_OPTIONS}) + "\n"
    return _checked(_ll().LLMatcher.grammar_from_lark(lark))


class Vocab:
    """llguidance's view of a tokenizer.json for a model whose logits have
    `n_vocab` entries, EOS = `eos_ids`. Built on first use (seconds for a
    150k vocabulary), once per process; thread-safe."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_ids):
        self.path, self.n_vocab, self.eos_ids = str(tokenizer_json), int(n_vocab), sorted(int(e) for e in eos_ids)
        self._tok = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                with open(self.path, encoding="utf-8") as f:
                    text = f.read()
                eos = self.eos_ids or None
                self._tok = _ll().LLTokenizer(text, n_vocab=self.n_vocab, eos_token=eos)
            return self._tok

    @staticmethod
    def available() -> bool:
        return available()

    @property
    def words(self) -> int:
        return (self.n_vocab + 31) // 32

    def matcher(self, grammar: str) -> "Matcher":
        return Matcher(self, grammar)


@functools.lru_cache(maxsize=8)
def _eos_bits(words: int, eos: tuple) -> np.ndarray:
    bits = np.zeros(words, np.uint32)
    for e in eos:
        if e < 32 * words:
            bits[e // 32] |= np.uint32(1 << (e % 32))
    return bits.view(np.int32)


class Matcher:
    """One row's grammar state: `mask()` for its next token, `advance(id)`
    with the id it drew. A row that drew past the grammar (possible only
    through a grammar error) or finished it gets EOS-only masks."""

    def __init__(self, vocab: Vocab, grammar: str):
        ll = _ll()
        self.vocab = vocab
        self._m = ll.LLMatcher(vocab.tokenizer(), grammar, log_level=0)
        if self._m.is_error():
            raise UserError(f"the grammar is not usable: {self._m.get_error()}")
        self._bits = np.empty((1, vocab.words), np.int32)

    def mask(self) -> np.ndarray:
        """int32 [words]: bit t set = token t allowed next."""
        m = self._m
        if m.is_stopped() or m.is_error():
            return _eos_bits(self.vocab.words, tuple(self.vocab.eos_ids))
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            return _eos_bits(self.vocab.words, tuple(self.vocab.eos_ids))
        return self._bits[0].copy()

    def advance(self, tok: int) -> None:
        if not (self._m.is_stopped() or self._m.is_error()):
            self._m.consume_token(int(tok))

    @property
    def done(self) -> bool:
        return self._m.is_stopped() or self._m.is_accepting()
