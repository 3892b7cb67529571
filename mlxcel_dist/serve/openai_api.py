"""OpenAI's request bodies: parsed and checked (responses.py builds the answers).

Pure functions, no I/O: the HTTP app reads a body with :func:`loads_limited`
and turns it into a :class:`Parsed` with :func:`parse` (every refusal an
:class:`ApiError` shaped as OpenAI's errors). The pydantic models :class:`ChatCompletionRequest` and
:class:`CompletionRequest` check the shapes and double as the OpenAPI schema;
what depends on the served model (its vocabulary, context, cap, template)
is checked here after them, against a :class:`ParseContext`.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import grammar
from ..errors import UserError
from ..sampling import SamplingParams
from . import reasoning
from . import tools as tools_fmt
from .wire import WIRE_LIMITS, GenRequest, check_wire

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512  # mlx-lm's server default (--max-tokens 512)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs
MAX_N = 16  # choices per request
MAX_PROMPTS = 1024  # prompts in one completions request (each its n choices)
ROLES = ("system", "developer", "user", "assistant", "tool")


# Errors ---------------------------------------------------------------------------
class ApiError(Exception):
    """One OpenAI-shaped error: HTTP status plus the `error` object's fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code=None, type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.code = None if code is None else str(code)  # OpenAI's code is a string (clients match on it)
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _show(v) -> str:
    """A request value for a message: JSON, bounded. A huge int is described,
    not printed (Python refuses int -> str past 4300 digits)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"an integer of about {int(v.bit_length() * math.log10(2))} digits"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    try:
        s = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        return f"a {type(v).__name__}"
    return s if len(s) <= 80 else s[:77] + "..."


# JSON -------------------------------------------------------------------------------
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NEST = np.zeros(256, np.int8)
_NEST[[ord("["), ord("{")]], _NEST[[ord("]"), ord("}")]] = 1, -1


def loads_limited(raw: bytes, max_depth: int = 64, max_number_chars: int = 64) -> object:
    """json.loads that fails only with ApiError 400: bad UTF-8, nesting past
    `max_depth` (json's C parser would hit RecursionError), number literals
    past `max_number_chars` (int() refuses 4300 digits; no field needs 64),
    NaN / Infinity (not JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                       f"({e.reason}); send JSON encoded as UTF-8") from None
    b = np.frombuffer(_STRING.sub("", text).encode("utf-8", "replace"), np.uint8)  # brackets outside strings
    depth = np.cumsum(_NEST[b], dtype=np.int64)
    if depth.size and int(depth.max()) > max_depth:
        raise ApiError(f"JSON nested deeper than {max_depth} levels")

    def number(kind):
        def parse(s: str):
            if len(s) > max_number_chars:
                raise ApiError(f"a JSON number of {len(s)} characters is over the limit of {max_number_chars}")
            return kind(s)
        return parse

    def constant(s: str):
        raise ApiError(f"{s} is not a JSON number (JSON has no NaN or Infinity)")

    try:
        return json.loads(text, parse_int=number(int), parse_float=number(float), parse_constant=constant)
    except json.JSONDecodeError as e:
        raise ApiError(f"malformed JSON: {e}") from None


# Request models (shapes and the OpenAPI schema) -------------------------------------
class _Strict(BaseModel):
    # strict: "5" is not 5, true is not 1; extra: fields OpenAI accepts (user, metadata, ...) pass
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolFunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunctionCall


class ChatMessage(_Strict):
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None  # null: assistant messages only
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class FunctionSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # constrained either way: the answer always follows the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool | None = None


_Stop = Annotated[str, Field(min_length=1)]


class _Common(_Strict):
    model: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N, description="choices, sharing one prefill; choice i samples "
                                                            "with seed + i")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=WIRE_LIMITS["top_k"][1], description="0 = off (vLLM's extra field)")
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, description="0 = off (vLLM's extra field)")
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False, description="1 = off")
    seed: int | None = Field(None, ge=0, le=WIRE_LIMITS["seed"][1])
    stop: _Stop | Annotated[list[_Stop], Field(max_length=16)] | None = None
    top_logprobs: int | None = Field(None, ge=-1, le=MAX_TOP_LOGPROBS)
    ignore_eos: bool | None = Field(None, description="vLLM's extra field: EOS is an ordinary token")
    speculative: bool | None = Field(None, description="false: no drafts for this request (a server started "
                                                       "with --draft-model / --prompt-lookup)")
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False,
                                           description="OpenAI's, over the generated tokens; 0 = off")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False,
                                            description="OpenAI's, over the generated tokens; 0 = off")
    logit_bias: dict[str, float] | None = Field(None, max_length=WIRE_LIMITS["logit_bias"][1],
                                                description="token id (a string) -> bias in [-100, 100]")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(
        max_length=WIRE_LIMITS["stop_token_ids"][1])] | None = Field(
        None, description="vLLM's extra field: generation ends at any of these token ids")
    response_format: ResponseFormat | None = Field(
        None, description="json_object / json_schema: the answer is constrained to valid JSON (to the schema)")


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="required / a named function: the call is forced by constrained decoding")
    chat_template_kwargs: dict | None = Field(None, description="vLLM's extra field: variables for the chat "
                                                                "template (e.g. enable_thinking)")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="the template's reasoning_effort (gpt-oss); only for templates that read it")


class CompletionRequest(_Common):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[int], Field(min_length=1, fail_fast=True)]
             | Annotated[list[Annotated[list[int], Field(min_length=1, fail_fast=True)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: bool | int | None = Field(None, description="k: the k most likely tokens (true: the chat form)")
    echo: bool | None = Field(None, description="the prompt before the answer, with its tokens' logprobs when "
                                                "'logprobs' is given (the first null); max_tokens 0: the prompt only")
    max_tokens: int | None = Field(None, ge=0)


STOP_MESSAGE = "'stop' must be a non-empty string or a list of at most 16 non-empty strings"
# Fields whose errors read better as one sentence than as pydantic's per-branch errors.
_SHAPES = {
    True: {"stop": STOP_MESSAGE, "logprobs": "'logprobs' must be true or false (the number of alternatives "
                                             "is 'top_logprobs')"},
    False: {"stop": STOP_MESSAGE,
            "prompt": f"'prompt' must be a string, a non-empty list of token ids, or a list of at most {MAX_PROMPTS} "
                      "of either",
            "logprobs": f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], or true / false"},
}
_KINDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
          "string_type": "a string", "model_type": "an object", "list_type": "a list"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _key(loc: tuple) -> tuple:
    """The field an error belongs to: a top-level name, or (messages, i, name)."""
    return loc[:3] if loc[0] == "messages" else loc[:1]


def _message_error(key: tuple, group: list[dict]) -> str:
    """The sentence for an error inside `messages`."""
    e = group[0]
    if len(key) == 1:
        return "missing field 'messages'" if e["type"] == "missing" else "'messages' must be a non-empty list"
    where = f"messages[{key[1]}]"
    if len(key) == 2 or (key[2] == "role" and not isinstance(e["input"], str)):
        return f"{where} must be an object with a string 'role'"
    if key[2] == "role":
        return f"{where}.role must be one of {', '.join(ROLES)}; got {_show(e['input'])}"
    if key[2] == "content" and any(len(x["loc"]) > 4 for x in group):
        return f"{where}.content: only text parts are supported"
    if key[2] == "content":
        return f"{where}.content must be a string or a list of text parts, got {_show(e['input'])}"
    return f"{where}.{key[2]}: {e['msg']}"


def _field_error(name: str, e: dict) -> str:
    """The sentence for one error of a plain field (the style of the checks below)."""
    kind, got = e["type"], _show(e.get("input"))
    if kind == "missing":
        return f"missing field '{name}'"
    if kind in _KINDS:
        return f"'{name}' must be {_KINDS[kind]}, got {got}"
    if kind in _BOUNDS:
        bound = next(iter(e["ctx"].values()))
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound  # ge=0, not 0.0
        return f"'{name}' must be {_BOUNDS[kind]} {_show(bound)}, got {got}"
    if kind == "finite_number":
        return f"'{name}' must be finite, got {got}"
    return f"'{name}': {e['msg']}, got {got}"


def _from_pydantic(err: ValidationError, chat: bool) -> ApiError:
    """One ApiError (param: the top-level field) for a ValidationError's first field."""
    errors = err.errors(include_url=False)
    key = _key(errors[0]["loc"])
    group = [e for e in errors if _key(e["loc"]) == key]
    param = str(key[0])
    for e in group:  # pydantic's own name for a lone surrogate; ours says where
        if e["type"] == "string_unicode":
            _text(e["input"], f"messages[{key[1]}].{key[2]}" if len(key) == 3 else f"'{param}'")
    if param == "messages":
        return ApiError(_message_error(key, group), param=param)
    shape = _SHAPES[chat].get(param)
    if shape and group[0]["type"] != "missing":
        return ApiError(f"{shape}; got {_show(group[0]['input'])}", param=param)
    name = ".".join(str(x) for x in group[0]["loc"])
    return ApiError(_field_error(name, group[0]), param=param)


# Request checks that need the served model ------------------------------------------
@dataclass
class Defaults:
    """Server-wide defaults a request may override (serve's --temp ... flags)."""

    temp: float = 1.0  # OpenAI's default (mlx-lm's server: 0)
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None  # None: 512 for chat (mlx-lm's), 16 for completions (OpenAI's)


@dataclass
class ParseContext:
    """What parsing needs to know about the served model."""

    tokenizer: object  # tokenizer.Tokenizer
    vocab_size: int
    model_ids: tuple  # the served id first, then aliases (vLLM's --served-model-name)
    max_tokens_cap: int = 4096
    context_length: int | None = None
    defaults: Defaults = field(default_factory=Defaults)
    plain_chat: bool = False  # no chat template: mlx-lm's convert_chat rendering
    tool_format: str | None = None  # serve.tools: the format the template writes calls in (None: no tools)
    grammar_refusal: str | None = None  # why constrained decoding is not served (None: it is)
    reasoning_format: str | None = None  # serve.reasoning: the form the template thinks in (None: no split)
    template_vars: frozenset = frozenset()  # the names the chat template reads (reasoning_effort's check)
    keep_special: bool = False  # the reasoning / tool markers are special tokens here: detokenise keeping them
    logprobs_ok: bool = True  # False for models with their own generation loop
    max_n: int = MAX_N  # choices a request may ask for (at most the rows the batch holds)
    ignore_eos_ok: bool = True  # False for those too: their loop ends at EOS itself
    special: dict | None = None  # grammar markers that are special tokens here (special_markers fills it)


@dataclass
class Parsed:
    req: GenRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage
    model: str  # the id the responses echo
    chat: bool
    tool_format: str | None = None  # parse the answer for tool calls in this format (serve.tools)
    n: int = 1  # choices
    reasoning: str | None = None  # split the answer's thinking off in this form (serve.reasoning)
    thinking: bool = False  # ... the answer begins inside the thinking (the template opened it)
    keep_special: bool = False  # detokenise with special tokens kept (harmony's markers)
    tools: list | None = None  # the request's tools (their schemas type the XML call formats' values)
    forced: bool = False  # tool_choice required / named: the answer is calls only (a cut one is dropped)
    prompts: list | None = None  # several prompts (completions): their ids, n choices each (None: req's alone)
    echo: bool = False  # completions' echo: the prompt (and its logprobs) before each choice's answer

    @property
    def choices(self) -> int:
        return self.n * (len(self.prompts) if self.prompts else 1)

    @property
    def prompt_tokens(self) -> int:
        """usage's prompt_tokens: each prompt once (its n choices share it)."""
        return sum(map(len, self.prompts)) if self.prompts else len(self.req.prompt_ids)


def no_chat_template(tokenizer) -> bool:
    """True when the checkpoint has no chat template (ParseContext.plain_chat)."""
    try:
        tokenizer.chat_template()
    except UserError as e:
        return "no chat template" in str(e)
    return False


def context_limit(config: dict | None) -> int | None:
    """The model's context length: config.json's max_position_embeddings
    (a multimodal config's text_config); None when it gives none."""
    config = config or {}
    v = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def context_error(limit: int, prompt: int, completion: int, where: str = "messages") -> ApiError:
    """vLLM's wording, OpenAI's code; `where`: "messages" (chat) or "prompt"."""
    return ApiError(
        f"This model's maximum context length is {limit} tokens. However, you requested {prompt + completion} "
        f"tokens ({prompt} in the {where}, {completion} in the completion). Please reduce the length of the "
        f"{where} or completion.", param=where, code="context_length_exceeded")


def _text(s: str, where: str) -> str:
    """`s` if it is text the tokenizer can take (JSON's \\ud800-style escapes
    can carry lone UTF-16 surrogates, which are not Unicode text)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"{where} is not valid Unicode text: a lone UTF-16 surrogate "
                       f"U+{ord(s[e.start]):04X} at character {e.start}",
                       param=where.strip("'").split("[")[0]) from None
    return s


# OpenAI request fields this server does not implement: a request that asks
# for one (any value but the neutral ones) gets HTTP 400 naming it, never a
# silently different answer. Fields without effect on the output (user,
# metadata, store, service_tier, parallel_tool_calls, ...) are accepted.
def _neutral(*values):
    return lambda v: v is None or any(v == n and type(v) is type(n) for n in values)


UNSUPPORTED = {
    "best_of": (_neutral(1), "one candidate per request ('best_of': 1)"),
    "suffix": (_neutral(""), "no insertion (suffix) mode"),
    "functions": (_neutral([]), "the deprecated form is not served; send 'tools'"),
    "function_call": (_neutral("none", "auto"), "the deprecated form is not served; send 'tool_choice'"),
    "modalities": (lambda v: v is None or v == ["text"], "text output only"),
    "audio": (_neutral(), "text output only"),
    "prediction": (_neutral(), "no predicted outputs"),
    "web_search_options": (_neutral(), "no web search"),
}


def _check_unsupported(body: dict) -> None:
    for name, (ok, why) in UNSUPPORTED.items():
        if name in body and not ok(body[name]):
            raise ApiError(f"'{name}' is not supported by this server: {why}; got {_show(body[name])}",
                           param=name, code="unsupported_parameter")


def _logprobs(m, chat: bool) -> int | None:
    """None (off) or k: OpenAI's chat form (`logprobs: true`, `top_logprobs:
    k`), its completions form (`logprobs: k`); completions also take the
    chat form, as mlx-lm's server does (whose "none" is top_logprobs -1)."""
    lp, top = m.logprobs, m.top_logprobs
    if lp is None or lp is False:
        if top not in (None, 0, -1):
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    if lp is True:
        return 0 if top in (None, -1) else top
    if top is not None:
        raise ApiError("give 'logprobs': k, or 'logprobs': true with 'top_logprobs': k, not both numbers",
                       param="top_logprobs")
    if not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise ApiError(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {_show(lp)}", param="logprobs")
    return lp


def _encode(ctx: ParseContext, text: str, where: str) -> list[int]:
    _text(text, where)
    try:
        return ctx.tokenizer.encode(text)
    except Exception as e:  # noqa: BLE001 - a tokenizer failure is the request's problem
        raise ApiError(f"the tokenizer cannot take {where}: {type(e).__name__}: {e}",
                       param=where.strip("'")) from None


def _completion_ids(m: CompletionRequest, ctx: ParseContext) -> list[list[int]]:
    """Each prompt's ids: a string or an id list is one prompt, a list of
    strings or of id lists several (OpenAI's four forms)."""
    many = isinstance(m.prompt, list) and not isinstance(m.prompt[0], int)
    out = []
    for i, p in enumerate(m.prompt if many else [m.prompt]):
        where = f"'prompt'[{i}]" if many else "'prompt'"
        if isinstance(p, str):
            ids = _encode(ctx, p, where)
        else:
            bad = [t for t in p if not 0 <= t < ctx.vocab_size]
            if bad:
                raise ApiError(f"token id {_show(bad[0])} in {where} is outside the vocabulary [0, {ctx.vocab_size})",
                               param="prompt")
            ids = list(p)
        if not ids:
            raise ApiError(f"{where} is empty and the tokenizer adds no BOS token", param="prompt")
        out.append(ids)
    return out


def _chat_messages(m: ChatCompletionRequest) -> list[dict]:
    """[{role, content}] with text parts joined; content null only for
    assistant; an assistant's tool calls as transformers' templates read
    them (arguments as an object), a tool message's call id and name."""
    out = []
    for i, msg in enumerate(m.messages):
        c = msg.content
        if c is None and msg.role != "assistant":
            raise ApiError(f"messages[{i}].content must be a string or a list of text parts (null only for "
                           "an assistant message)", param="messages")
        c = "".join(part.text for part in c) if isinstance(c, list) else c or ""
        entry = {"role": msg.role, "content": _text(c, f"messages[{i}].content")}
        if msg.tool_calls:
            calls = []
            for j, call in enumerate(msg.tool_calls):
                try:
                    args = json.loads(call.function.arguments)
                except ValueError:
                    raise ApiError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON text",
                                   param="messages") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            entry["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if getattr(msg, key) is not None:
                entry[key] = getattr(msg, key)
        out.append(entry)
    return out


def _tool_format(m, chat: bool, ctx: ParseContext) -> tuple[str | None, bool]:
    """(the format the answer's calls are parsed in, None: no tools; whether
    the tools go into the prompt as serve.tools' fallback block because the
    template writes no format): calls forced (required / named) need no
    template format, `auto` does (a 400 naming the flag), `none` renders
    what the template renders, or nothing."""
    if not chat or not m.tools:
        return None, False
    known = ctx.tool_format is not None and not ctx.plain_chat
    if known:
        return (ctx.tool_format if m.tool_choice != "none" else None), False
    if _forced(m, chat):
        return tools_fmt.FALLBACK, True
    if m.tool_choice == "none":
        return None, False
    raise ApiError("'tools' is not supported for this model with tool_choice 'auto': its chat template writes no "
                   f"tool-call format this server parses ({', '.join(tools_fmt.FORMATS)}; serve --tool-call-parser "
                   "names one); tool_choice 'required' or a named function works without one",
                   param="tools", code="unsupported_parameter")


RESERVED_TEMPLATE_VARS = ("messages", "tools", "documents", "add_generation_prompt")


def _template_kwargs(m: ChatCompletionRequest, ctx: ParseContext) -> dict:
    """chat_template_kwargs, and reasoning_effort for a template that reads it."""
    kwargs = dict(m.chat_template_kwargs or {})
    if kwargs and ctx.plain_chat:
        raise ApiError("'chat_template_kwargs' is not supported for this model: it has no chat template",
                       param="chat_template_kwargs", code="unsupported_parameter")
    for key in kwargs:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key) or key in RESERVED_TEMPLATE_VARS:
            raise ApiError(f"'chat_template_kwargs' keys must be template variable names other than "
                           f"{', '.join(RESERVED_TEMPLATE_VARS)}; got {_show(key)}", param="chat_template_kwargs")
    if m.reasoning_effort is not None:
        if "reasoning_effort" not in ctx.template_vars:
            raise ApiError("'reasoning_effort' is not supported for this model: its chat template has no "
                           "reasoning_effort setting", param="reasoning_effort", code="unsupported_parameter")
        kwargs.setdefault("reasoning_effort", m.reasoning_effort)
    return kwargs


def _chat_ids(m: ChatCompletionRequest, ctx: ParseContext, fallback: bool) -> tuple[list[int], str]:
    """The rendered conversation's ids and its text; `fallback`: the tools
    written into the messages (serve.tools.fallback_messages), not given to the template."""
    out = _chat_messages(m)
    tools = [t.model_dump(exclude_none=True) for t in m.tools] if m.tools else None
    if fallback:
        out, tools = tools_fmt.fallback_messages(out, tools), None
    elif ctx.plain_chat or ctx.tool_format is None:
        tools = None  # tool_choice none, no format: nothing of the tools is rendered
    kwargs = _template_kwargs(m, ctx)
    if ctx.plain_chat:
        rm = (m.model_extra or {}).get("role_mapping")  # mlx-lm's extra field
        if rm is not None and not (isinstance(rm, dict) and all(isinstance(v, str) for v in rm.values())):
            raise ApiError("'role_mapping' must be an object of strings", param="role_mapping")
        text = convert_chat(out, rm)
        ids = _encode(ctx, text, "'messages'")
    else:
        try:
            text = ctx.tokenizer.render_chat(out, tools=tools, **kwargs)
            ids = ctx.tokenizer.encode(text, add_special_tokens=False)
        except UserError as e:
            raise ApiError(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a tokenizer failure is the request's problem
            raise ApiError(f"the tokenizer cannot take the rendered messages: {type(e).__name__}: {e}",
                           param="messages") from None
    if not ids:
        raise ApiError("the rendered conversation is empty", param="messages")
    return ids, text


def _forced(m, chat: bool) -> bool:
    """tool_choice `required` or a named function: calls forced by a grammar."""
    choice = m.tool_choice if chat else None
    return choice == "required" or isinstance(choice, NamedToolChoice)


def special_markers(ctx: ParseContext) -> dict:
    """The grammars' markers (grammar.MARKERS) that are special tokens of the
    served vocabulary -> their ids (one token each, dropped by plain decoding);
    computed once per context."""
    if ctx.special is None:
        tok, found = ctx.tokenizer, {}
        for marker in grammar.MARKERS:
            try:
                ids = tok.encode(marker, add_special_tokens=False)
                if len(ids) == 1 and tok.decode(ids) != marker:
                    found[marker] = int(ids[0])
            except Exception:  # noqa: BLE001 - a tokenizer that cannot take it: written as text
                pass
        ctx.special = found
    return ctx.special


def _grammar(m, chat: bool, ctx: ParseContext, think: str | None = None, tool_format: str | None = None):
    """The constraining grammar's text or None: tool_choice `required` / a
    named function (the served tool-call format, arguments valid under each
    function's parameters), else response_format json_object / json_schema;
    with `think` (grammar.thinking) after the model's thinking."""
    choice = m.tool_choice if chat else None
    forced = _forced(m, chat)
    fmt = m.response_format.type if m.response_format is not None else "text"
    if not forced and fmt == "text":
        return None
    param = "tool_choice" if forced else "response_format"
    if ctx.grammar_refusal is not None:
        raise ApiError(f"'{param}' needs constrained decoding, which this server does not serve: "
                       f"{ctx.grammar_refusal}", param=param, code="unsupported_parameter")
    special = special_markers(ctx)
    try:
        if forced:
            if not m.tools:
                raise ApiError(f"'tool_choice' {_show(choice if choice == 'required' else choice.model_dump())} "
                               "needs 'tools'", param="tool_choice")
            tools = [t.model_dump(exclude_none=True) for t in m.tools]
            name = None if choice == "required" else choice.function.name
            if name is not None and name not in [t["function"]["name"] for t in tools]:
                raise ApiError(f"'tool_choice' names function {_show(name)}, which is not in 'tools'",
                               param="tool_choice")
            parallel = (m.model_extra or {}).get("parallel_tool_calls", True)
            if not isinstance(parallel, bool):
                raise ApiError("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
            return grammar.tool_calls(tool_format or ctx.tool_format, tools, name, many=parallel and name is None,
                                      think=think, special=special)
        if fmt == "json_object":
            return grammar.json_object(think, special)
        spec = m.response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise ApiError("'response_format' json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                           param="response_format")
        return grammar.json_schema(spec.schema_, think, special)
    except UserError as e:
        code = "unsupported_parameter" if not grammar.available() else None
        raise ApiError(f"'{param}': {e}", param=param, code=code) from None


def _max_tokens(m, chat: bool, n_prompt: int, ctx: ParseContext) -> int:
    """The client's number (<= the cap) or the default, then the context check
    (a default, not the client's number, shrinks to what fits)."""
    name = "max_completion_tokens" if chat and m.max_completion_tokens is not None else "max_tokens"
    asked = getattr(m, name)
    cap = ctx.max_tokens_cap
    if asked is not None and asked > cap:
        raise ApiError(f"'{name}' must be <= {cap}, got {_show(asked)}", param=name)
    default = ctx.defaults.max_tokens
    if default is None:
        default = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
    n = min(default, cap) if asked is None else asked
    limit = ctx.context_length
    if limit is not None:
        if asked is None and n_prompt < limit:
            n = min(n, limit - n_prompt)
        if n_prompt + n > limit:
            raise context_error(limit, n_prompt, n, "messages" if chat else "prompt")
    return n


def _logit_bias(bias: dict | None, vocab: int) -> tuple:
    """OpenAI's {"token id": bias} -> ((id, bias), ...) sorted by id; a key
    that is not a token id of this model, or a bias outside [-100, 100], is a 400."""
    out = {}
    for key, value in (bias or {}).items():
        if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) >= vocab:
            raise ApiError(f"'logit_bias' keys must be token ids in [0, {vocab}), got {_show(key)}",
                           param="logit_bias")
        if not -100.0 <= value <= 100.0 or value != value:
            raise ApiError(f"'logit_bias' values must be in [-100, 100], got {_show(value)} for token {key}",
                           param="logit_bias")
        out[int(key)] = float(value)
    return tuple(sorted(out.items()))


def _sampling(m, d: Defaults, vocab: int) -> SamplingParams:
    def pick(v, default):
        return default if v is None else v

    seed = m.seed if m.seed is not None else int.from_bytes(uuid.uuid4().bytes[:8], "little")
    s = SamplingParams(temp=float(pick(m.temperature, d.temp)), top_p=float(pick(m.top_p, d.top_p)),
                       top_k=int(pick(m.top_k, d.top_k)), min_p=float(pick(m.min_p, d.min_p)),
                       repetition_penalty=float(pick(m.repetition_penalty, 1.0)), seed=seed,
                       presence_penalty=float(pick(m.presence_penalty, 0.0)),
                       frequency_penalty=float(pick(m.frequency_penalty, 0.0)),
                       logit_bias=_logit_bias(m.logit_bias, vocab))
    try:
        return s.validate()
    except UserError as e:
        raise ApiError(str(e)) from None


def _model(asked: str | None, ctx: ParseContext) -> str:
    """The id to echo: the client's name when it is one we serve (404 otherwise, as OpenAI)."""
    if asked is None:
        return ctx.model_ids[0]
    if asked not in ctx.model_ids:
        raise ApiError(f"The model `{asked}` does not exist.", status=404, param="model", code="model_not_found")
    return asked


def _stream(m) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options only with stream true (OpenAI's 400)."""
    stream = bool(m.stream)
    if m.stream_options is not None and not stream:
        raise ApiError("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options")
    return stream, bool(stream and m.stream_options and m.stream_options.include_usage)


def parse(body: object, chat: bool, ctx: ParseContext) -> Parsed:
    """A request body (chat or completions) -> Parsed; ApiError on anything refused."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_unsupported(body)
    try:
        m = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        raise _from_pydantic(e, chat) from None
    model = _model(m.model, ctx)
    stream, include_usage = _stream(m)
    n = 1 if m.n is None else m.n
    if n > ctx.max_n:
        raise ApiError(f"'n' must be <= {ctx.max_n} on this server (the rows a step holds: serve "
                       f"--decode-concurrency; 1 for a model with its own generation loop), got {n}", param="n")
    logprobs = _logprobs(m, chat)
    if logprobs is not None and not ctx.logprobs_ok:
        raise ApiError("'logprobs' is not supported for this model (it runs its own generation loop)",
                       param="logprobs", code="unsupported_parameter")
    if m.ignore_eos and not ctx.ignore_eos_ok:
        raise ApiError("'ignore_eos' is not supported for this model (its own generation loop ends at EOS)",
                       param="ignore_eos", code="unsupported_parameter")
    tool_format, fallback = _tool_format(m, chat, ctx)
    if chat:
        ids, text = _chat_ids(m, ctx, fallback)
        prompts = [ids]
    else:
        prompts, text = _completion_ids(m, ctx), ""
        ids = prompts[0]
    stops = [_text(s, "'stop'") for s in ([m.stop] if isinstance(m.stop, str) else m.stop or [])]
    stop_ids = list(m.stop_token_ids or [])
    if any(t >= ctx.vocab_size for t in stop_ids):
        raise ApiError(f"'stop_token_ids' must be token ids in [0, {ctx.vocab_size})", param="stop_token_ids")
    fmt = ctx.reasoning_format if chat and not ctx.plain_chat else None
    if tool_format == "harmony" and fmt is None:  # harmony's calls are messages: the channels split first
        fmt = "gpt_oss"
    # a constrained answer's grammar lets the model think first (its thinking split off as usual)
    gram = _grammar(m, chat, ctx, grammar.thinking(fmt, text), tool_format)
    longest = max(prompts, key=len)  # every prompt must fit with max_tokens
    echo = bool(not chat and m.echo)
    if chat and body.get("echo"):
        raise ApiError("'echo' is not supported by this server for chat: a completions field (chat answers never "
                       f"repeat the messages); got {_show(body['echo'])}", param="echo", code="unsupported_parameter")
    if echo and not ctx.logprobs_ok:
        raise ApiError("'echo' is not supported for this model (it runs its own generation loop)", param="echo",
                       code="unsupported_parameter")
    max_tokens = _max_tokens(m, chat, len(longest), ctx)
    if max_tokens == 0 and not echo:
        raise ApiError("'max_tokens' must be >= 1, got 0 (0 only with 'echo': the prompt's logprobs alone)",
                       param="max_tokens")
    if echo and gram is not None:
        raise ApiError("'echo' with a constrained answer (response_format, forced tools) is not served",
                       param="echo", code="unsupported_parameter")
    req = GenRequest(ids, max_tokens, _sampling(m, ctx.defaults, ctx.vocab_size), stops,
                     logprobs, bool(m.ignore_eos), stop_ids, gram, m.speculative is not False,
                     (logprobs or 0) if echo else None)
    try:
        check_wire(req)  # defence in depth: the checks above should already hold every wire limit
    except ValueError as e:
        name = re.match(r"'(\w+)'", str(e))
        raise ApiError(str(e), param=name and name.group(1).replace("prompt_tokens", "prompt")) from None
    keep = (fmt in reasoning.KEEPS_SPECIAL or tool_format in tools_fmt.KEEPS_SPECIAL
            or (ctx.keep_special and (fmt is not None or tool_format is not None)))
    return Parsed(req, stream, include_usage, model, chat, tool_format, n, fmt,
                  fmt is not None and reasoning.starts_thinking(fmt, text), keep,
                  [t.model_dump(exclude_none=True) for t in m.tools] if tool_format else None,
                  _forced(m, chat) and tool_format is not None, prompts if len(prompts) > 1 else None, echo)


# Chat rendering without a template -------------------------------------------------
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
