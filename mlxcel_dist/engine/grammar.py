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
import os
import re
import sys
import threading
import time

import numpy as np

from ..errors import UserError

INSTALL_HINT = "pip install 'mlxcel-dist[grammar]' (llguidance)"
# Compact JSON: no free whitespace between tokens, so a model cannot spend its
# max_tokens on blanks inside an answer (OpenAI's outputs are compact too).
JSON_OPTIONS = {"whitespace_flexible": False}


# llguidance's parser limits, raised where its defaults refuse what clients
# send: a row of an Earley set holds ~4 items per optional property, so the
# default 2000 gave up mid-answer on an object of 500 optional properties
# (tools with thousands of optional parameters); 200k holds 50k of them.
LIMITS = {"max_items_in_row": 200_000, "step_max_items": 500_000}


@functools.cache
def _limits():
    return _ll().LLParserLimits(**LIMITS)


def available() -> bool:
    return importlib.util.find_spec("llguidance") is not None


def _ll():
    try:
        import llguidance
    except ImportError:
        raise UserError(f"constrained decoding needs llguidance: {INSTALL_HINT}") from None
    return llguidance


def _brief(message) -> str:
    """llguidance's message without the grammar it quotes (a large schema's
    would make a 400 of megabytes): its first line, at most 300 characters."""
    line = str(message).strip().split("\n", 1)[0]
    return line if len(line) <= 300 else line[:297] + "..."


def _checked(grammar: str) -> str:
    """`grammar` if llguidance accepts it, else UserError with its message."""
    is_error, messages = _ll().LLMatcher.validate_grammar_with_warnings(grammar, limits=_limits())
    if is_error:
        raise UserError(f"the grammar is not usable: {_brief(messages[0] if messages else 'invalid')}")
    return grammar


def json_schema(schema, think: str | None = None, special: dict | None = None) -> str:
    """The grammar of JSON documents valid under `schema` (a dict); with
    `think` (`thinking`'s mode), after the model's free thinking."""
    if not isinstance(schema, dict):
        raise UserError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    if think is None:
        try:
            grammar = _ll().LLMatcher.grammar_from_json_schema(closed(schema), defaults=JSON_OPTIONS)
        except ValueError as e:
            raise UserError(f"the JSON schema is not usable: {_brief(e)}") from None
        return _checked(grammar)
    head = _seq(H_CHANNEL + "final" + H_MESSAGE, special) if think == "harmony" else ""
    return _lark(["start: " + " ".join(x for x in (_thought(think, special), head, "answer") if x),
                  "answer: " + _json(schema), *_thought_rules(think, special)])


def json_object(think: str | None = None, special: dict | None = None) -> str:
    """Any JSON object (OpenAI's `json_object` mode)."""
    return json_schema({"type": "object"}, think, special)


# Markers written by the grammars below: where one is a special token of the
# served vocabulary (`special`: marker -> id) the grammar names that token
# (`<[id]>`), as the model writes it, else the marker's text.
DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                   "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        "<|tool_calls_section_end|>")
GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
MINIMAX = ("<minimax:tool_call>", "</minimax:tool_call>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
H_CHANNEL, H_MESSAGE, H_END, H_START, H_CONSTRAIN = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>",
                                                    "<|constrain|>")
MARKERS = (DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END, *KIMI, *GLM, *MINIMAX, "[TOOL_CALLS]", THINK_OPEN,
           THINK_CLOSE, H_CHANNEL, H_MESSAGE, H_END, H_START, H_CONSTRAIN)


NL = "\n"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _seq(text: str, special: dict | None) -> str:
    """`text` as a Lark sequence: its special-token markers as tokens, the rest literal."""
    if not text:
        return ""
    keys = sorted((special or {}), key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, keys)) + ")", text) if keys else [text]
    return " ".join(f"<[{special[p]}]>" if p in (special or {}) else _lit(p) for p in parts if p)


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**closed(schema), "x-guidance": JSON_OPTIONS})


# A schema's sub-schemas, by how a keyword holds them (everything else, e.g.
# const / enum / default, is a value: never rewritten).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties", "additionalItems")


def closed(schema, keep_open: bool = False):
    """`schema` with every object that lists `properties` (or
    `patternProperties`) and says nothing of `additionalProperties` closed:
    no keys beyond its own, as xgrammar (vLLM's default backend) and outlines
    do; `additionalProperties: true` (or a schema) keeps them open, and an
    object without properties (json_object) stays any object. An `allOf`
    branch is left open (`keep_open`): its keys are the other branches' too."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            v = {name: closed(sub) for name, sub in v.items()}
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            v = [closed(sub, k == "allOf") for sub in v]
        elif k in _SCHEMA_ONE:
            v = closed(v)
        out[k] = v
    if not keep_open and ("properties" in out or "patternProperties" in out) and not any(
            k in out for k in ("additionalProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _lark(rules: list) -> str:
    try:
        return _checked(_ll().LLMatcher.grammar_from_lark("\n".join(rules) + "\n"))
    except ValueError as e:
        raise UserError(f"the grammar is not usable: {_brief(e)}") from None


# Thinking before the constrained part (vLLM applies structured output after
# the reasoning): `think` says how the answer starts. "open": inside a block
# the template opened; "maybe": a think block may open it; "harmony": gpt-oss's
# analysis message may come first. The thinking is free text up to its end.
THINK_MODES = ("open", "maybe", "harmony")


def thinking(fmt: str | None, prompt_text: str) -> str | None:
    """The `think` mode of an answer in reasoning form `fmt` (serve.reasoning)
    to this rendered prompt; None: no thinking (no form, or the template
    closed an empty block: thinking switched off)."""
    if fmt is None:
        return None
    if fmt == "gpt_oss":
        return "harmony"
    at_open, at_close = prompt_text.rfind(THINK_OPEN), prompt_text.rfind(THINK_CLOSE)
    if at_open > at_close:
        return "open"
    return None if at_close >= 0 and not prompt_text[at_close + len(THINK_CLOSE):].strip() else "maybe"


def _thought(think: str | None, special: dict | None) -> str:
    """The thinking as a Lark expression (its rules: `_thought_rules`)."""
    if think is None:
        return ""
    if think == "harmony":
        return f"({_seq(H_CHANNEL + 'analysis' + H_MESSAGE, special)} thought {_seq(H_START + 'assistant', special)})?"
    if think == "open":
        return "thought THINK_WS?"
    if think == "maybe":
        return f"(THINK_WS? {_seq(THINK_OPEN, special)} thought THINK_WS?)?"
    raise ValueError(f"unknown thinking mode {think!r}")


def _thought_rules(think: str | None, special: dict | None) -> list:
    """`thought`: free text through its end marker. A special token never
    occurs in text, so the text runs until the model writes it; a marker
    written as text ends a lazy lexeme at its first occurrence."""
    if think is None:
        return []
    end = H_END if think == "harmony" else THINK_CLOSE
    if special and end in special:
        rules = [f"thought: THOUGHT <[{special[end]}]>", "THOUGHT: /(.|\\n)*/"]
    else:
        rules = ["thought[lazy]: /(.|\\n)*" + re.escape(end).replace("/", "\\/") + "/"]
    return rules + ([] if think == "harmony" else ["THINK_WS: /[ \\t\\n]{1,4}/"])


def _call_schema(tool: dict, args_key: str, defs: dict) -> dict:
    """A call's JSON object: the name, the arguments under `args_key`. The
    parameters' own refs (`#/$defs/X`, `#` itself: pydantic's nested and
    recursive models) would point into the wrapper: they move into `defs`
    (the wrapper's root `$defs`, under the tool's index), their refs rewritten."""
    fn, params = tool["function"], _params(tool)
    if _has_ref(params):
        key = f"tool{len(defs)}"
        defs[key] = _rebased(params, f"#/$defs/{key}")
        params = {"$ref": f"#/$defs/{key}"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


_LITERAL_KEYS = ("const", "enum", "default", "examples")  # values, not schemas: no refs inside


def _has_ref(schema) -> bool:
    if isinstance(schema, dict):
        return any(k == "$ref" or (k not in _LITERAL_KEYS and _has_ref(v)) for k, v in schema.items())
    return isinstance(schema, list) and any(_has_ref(v) for v in schema)


def _rebased(schema, base: str):
    """`schema` with its local refs (`#...`) made relative to `base`, where it now lives."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else v if k in _LITERAL_KEYS else _rebased(v, base)) for k, v in schema.items()}


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


# The tool-call formats `tool_calls` writes grammars for: all of serve.tools.FORMATS
FORCED_FORMATS = ("hermes", "llama3_json", "mistral", "harmony", "deepseek_v3", "deepseek_v31", "glm45", "kimi_k2",
                  "minimax_m2")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _xml_args(tool: dict, fmt: str, special: dict | None) -> str:
    """An XML format's arguments (glm45, minimax_m2) as a Lark sequence: each
    property of the parameters' schema in order, the required ones always;
    a string value bare (the templates write it so, serve.tools reads it
    back as a string: type string, or an enum of non-JSON strings), any
    other as JSON."""
    params = _params(tool)
    fn = tool["function"]["name"]
    root = re.fullmatch(r"#/(\$defs|definitions)/([^/~]+)", str(params.get("$ref", "")))
    target = root and (params.get(root.group(1)) or {}).get(root.group(2))
    if isinstance(target, dict):  # pydantic's recursive model: the object itself is a definition
        params = {**{k: v for k, v in params.items() if k != "$ref"}, **target}
    if params.get("type", "object") != "object" or any(k in params for k in ("anyOf", "oneOf", "allOf", "$ref")):
        raise UserError(f"function {fn!r}: the {fmt} format's forced calls need 'parameters' of type object")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    required = set(params.get("required") or [])
    props = dict(params.get("properties") or {})
    props.update({k: {} for k in required if k not in props})
    out = []
    for key, schema in props.items():
        schema = schema if isinstance(schema, dict) else {}
        choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if choices and all(isinstance(v, str) and not _is_json(v) for v in choices):
            value = "(" + " | ".join(map(_lit, choices)) + ")"  # written bare, read back as the string
        elif schema.get("type") == "string":
            if any(k in schema for k in ("pattern", "format", "enum", "const")):
                raise UserError(f"function {fn!r}, argument {key!r}: a string 'pattern' / 'format' / JSON-like "
                                f"enum is not built for the {fmt} format's forced calls (bare string values)")
            else:
                lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
                value = f"/[^<\\n]{{{lo},{'' if hi is None else int(hi)}}}/"
        else:
            value = _json({**schema, **defs})
        if fmt == "glm45":
            pair = " ".join((_seq(GLM[2] + key + GLM[3] + NL + GLM[4], special), value, _seq(GLM[5] + NL, special)))
        else:
            pair = " ".join((_lit('<parameter name="' + key + '">'), value, _lit("</parameter>" + NL)))
        out.append(f"({pair})" + ("" if key in required else "?"))
    return " ".join(out)


def tool_calls(fmt: str, tools: list, name: str | None = None, many: bool = False, think: str | None = None,
               special: dict | None = None) -> str:
    """A grammar that forces tool calls in `fmt` (serve.tools.FORMATS), as
    that format's template writes them: of function `name`, or (None:
    tool_choice `required`) of any of `tools`; one call, or with `many` one
    or more (OpenAI's parallel_tool_calls; harmony: one, a call ends the
    turn); each call's arguments valid under that function's parameter
    schema. `think`: the model's thinking first (`thinking`); `special`:
    the markers that are special tokens here."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    s = special

    def each(body) -> str:  # one call of any chosen function: body(tool, its name)
        return "(" + " | ".join(body(t, t["function"]["name"]) for t in chosen) + ")"

    def repeat(call: str, sep: str = "") -> str:
        return f"{call} ({_lit(sep)} {call})*" if many else call

    def args(t) -> str:
        return _json(_params(t))

    if fmt in ("hermes", "llama3_json", "mistral"):
        args_key = "parameters" if fmt == "llama3_json" else "arguments"
        defs = {}
        schemas = [_call_schema(t, args_key, defs) for t in chosen]
        call = _json({**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), **({"$defs": defs} if defs else {})})
        if fmt == "hermes":
            body = repeat(" ".join((_seq("<tool_call>" + NL, s), call, _seq(NL + "</tool_call>", s))), NL)
        elif fmt == "llama3_json":
            body = repeat(call, "; ")
        else:
            body = " ".join((_seq("[TOOL_CALLS][", s), repeat(call, ", "), _lit("]")))
    elif fmt == "harmony":  # <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS
        body = each(lambda t, n: _seq(f"{H_CHANNEL}commentary to=functions.{n} {H_CONSTRAIN}json{H_MESSAGE}", s)
                    + " " + args(t))
    elif fmt == "deepseek_v3":  # V3 / R1: the type, the name, the arguments fenced; calls a line apart
        call = each(lambda t, n: " ".join((_seq(f"{DS_CALL}function{DS_SEP}{n}{NL}```json{NL}", s), args(t),
                                           _seq(f"{NL}```{DS_END}", s))))
        body = " ".join((_seq(DS_CALLS, s), repeat(call, NL), _seq(DS_CALLS_END, s)))
    elif fmt == "deepseek_v31":  # V3.1: the name, the arguments
        call = each(lambda t, n: " ".join((_seq(DS_CALL + n + DS_SEP, s), args(t), _seq(DS_END, s))))
        body = " ".join((_seq(DS_CALLS, s), repeat(call), _seq(DS_CALLS_END, s)))
    elif fmt == "kimi_k2":  # functions.NAME:INDEX, the index the model's own count
        call = each(lambda t, n: " ".join((_seq(f"{KIMI[1]}functions.{n}:", s), "/0|[1-9][0-9]{0,2}/", _seq(KIMI[2], s),
                                           args(t), _seq(KIMI[3], s))))
        body = " ".join((_seq(KIMI[0], s), repeat(call), _seq(KIMI[4], s)))
    elif fmt == "glm45":  # GLM-4.5 / 4.6: a line, <tool_call>NAME, a line, the pairs; calls a line apart
        call = each(lambda t, n: " ".join((_seq(GLM[0] + n + NL, s), _xml_args(t, fmt, s), _seq(GLM[1], s))))
        body = f"{_lit(NL)}? {repeat(call, NL)}"
    elif fmt == "minimax_m2":  # a line, <minimax:tool_call>, a line, then <invoke> blocks of <parameter>s
        call = each(lambda t, n: " ".join((_lit(f'<invoke name="{n}">{NL}'), _xml_args(t, fmt, s),
                                           _lit("</invoke>" + NL))))
        body = " ".join((_lit(NL) + "?", _seq(MINIMAX[0] + NL, s), repeat(call), _seq(MINIMAX[1], s)))
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    return _lark(["start: " + " ".join(x for x in (_thought(think, s), body) if x), *_thought_rules(think, s)])


class Vocab:
    """llguidance's view of a tokenizer.json for a model whose logits have
    `n_vocab` entries, EOS = `eos_ids`. Built on first use (seconds for a
    150k vocabulary), once per process; thread-safe."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_ids, threads: int | None = None):
        """`threads`: llguidance's threads for `masks` (None: `mask_threads()`; 1: one
        matcher after the other on the calling thread)."""
        self.path, self.n_vocab, self.eos_ids = str(tokenizer_json), int(n_vocab), sorted(int(e) for e in eos_ids)
        self.threads = threads or mask_threads()
        self._tok = None
        self._lock = threading.Lock()
        self._compiled = {}  # grammar text -> its first Matcher (copied for each row)
        self._executor = None  # llguidance's thread pool for `masks`
        self._ahead = None  # the worker thread of `masks_ahead`
        self.ahead_clock = [0.0, 0.0]  # seconds summed: masks_ahead's start after submit, its work (masks, `then`)

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
        """A fresh matcher of `grammar`: a copy of the one compiled at its first
        use (LRU of 64: agents send the same schema / tools every request; a
        copy costs ~1 us, compiling ~0.5 ms)."""
        with self._lock:
            base = self._compiled.pop(grammar, None)
        if base is None:
            base = Matcher(self, grammar)
        with self._lock:
            self._compiled[grammar] = base
            while len(self._compiled) > 64:
                self._compiled.pop(next(iter(self._compiled)))
        return base.copy()

    def masks(self, matchers: list) -> np.ndarray:
        """int32 [k, words]: `Matcher.mask()` of each, computed in one llguidance
        call (its `threads`, the GIL released) into one buffer."""
        out = np.empty((len(matchers), self.words), np.int32)
        live = []
        for i, m in enumerate(matchers):
            if m._m.is_stopped() or m._m.is_error():
                out[i] = _eos_bits(self.words, tuple(self.eos_ids))
            else:
                live.append((m._m, i))
        if len(live) == 1 or (live and self.threads == 1):  # no hand-off to a pool (benchmarks/grammar_step.py)
            for m, i in live:
                m.unsafe_compute_mask_ptr(out[i].ctypes.data, out.strides[0])
        elif live:
            with self._lock:
                if self._executor is None:
                    self._executor = _ll().LLExecutor(self.threads)
            self._executor.unsafe_compute_mask_ptr(live, out.ctypes.data, out.strides[0], len(matchers))
        for m, i in live:
            if m.is_error():
                out[i] = _eos_bits(self.words, tuple(self.eos_ids))
        return out

    def masks_ahead(self, matchers: list, then=None):
        """`masks(matchers)` on this vocabulary's worker thread, passed through
        `then` there when given (the engine packs them there: sampling.packed_masks):
        a Future of them. The matchers must not move (`advance`) until it is done."""
        with self._lock:
            if self._ahead is None:
                from concurrent.futures import ThreadPoolExecutor

                self._ahead = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
                if sys.getswitchinterval() == PYTHON_SWITCH_S:  # (a process's own setting is kept)
                    sys.setswitchinterval(AHEAD_SWITCH_S)
        return self._ahead.submit(self._timed, matchers, then, time.perf_counter())

    def _timed(self, matchers: list, then, submitted: float):
        t0 = time.perf_counter()
        out = self.masks(matchers)
        if then is not None:
            out = then(out)
        self.ahead_clock[0] += t0 - submitted
        self.ahead_clock[1] += time.perf_counter() - t0
        return out


# The stepping thread holds the GIL between its MLX calls, and a thread waiting for it gets it
# at the switch interval (Python's 5 ms: longer than a GPU step), so masks computed ahead began
# only once the step waited for them; at 0.5 ms they run beside it (benchmarks/grammar_step.py
# --host-ms 2, 32 rows: the draw's wait for them 0.6 ms at 5 ms, about none at 0.5 ms).
PYTHON_SWITCH_S, AHEAD_SWITCH_S = 0.005, 0.0005


def mask_threads() -> int:
    """llguidance's threads for a batch's masks: half this process's CPUs, at most 8 (the
    rest for the device's host thread, the server, other ranks). On a loaded 2-core host
    its default pool took 1.2-1.9 ms for 16 rows where one thread took 0.23."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS)
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


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

    def __init__(self, vocab: Vocab, grammar: str | None, matcher=None):
        self.vocab = vocab
        if matcher is None:
            matcher = _ll().LLMatcher(vocab.tokenizer(), grammar, log_level=0, limits=_limits())
        self._m = matcher
        if self._m.is_error():
            raise UserError(f"the grammar is not usable: {_brief(self._m.get_error())}")
        self._bits = np.empty((1, vocab.words), np.int32)

    def copy(self) -> "Matcher":
        """An independent matcher in this one's state."""
        return Matcher(self.vocab, None, self._m.deep_copy())

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
    def error(self) -> str | None:
        """llguidance's reason when the grammar gave up (a limit hit), else None."""
        return _brief(self._m.get_error()) if self._m.is_error() else None

    @property
    def done(self) -> bool:
        return self._m.is_stopped() or self._m.is_accepting()
