"""OpenAI's request bodies as shapes: the errors (:class:`ApiError`, shaped
as OpenAI's), the body read within limits (:func:`loads_limited`), the
pydantic models (:class:`ChatCompletionRequest`, :class:`CompletionRequest`,
also the OpenAPI schema) with their errors as one sentence each
(:func:`validated`), and what parsing knows of the served model
(:class:`ParseContext`). openai_api.parse checks the rest against it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .wire import WIRE_LIMITS

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


def show(v) -> str:
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


def checked_text(s: str, where: str) -> str:
    """`s` if it is text the tokenizer can take (JSON's \\ud800-style escapes
    can carry lone UTF-16 surrogates, which are not Unicode text)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"{where} is not valid Unicode text: a lone UTF-16 surrogate "
                       f"U+{ord(s[e.start]):04X} at character {e.start}",
                       param=where.strip("'").split("[")[0]) from None
    return s


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
        return f"{where}.role must be one of {', '.join(ROLES)}; got {show(e['input'])}"
    if key[2] == "content" and any(len(x["loc"]) > 4 for x in group):
        return f"{where}.content: only text parts are supported"
    if key[2] == "content":
        return f"{where}.content must be a string or a list of text parts, got {show(e['input'])}"
    return f"{where}.{key[2]}: {e['msg']}"


def _field_error(name: str, e: dict) -> str:
    """The sentence for one error of a plain field (the style of the checks below)."""
    kind, got = e["type"], show(e.get("input"))
    if kind == "missing":
        return f"missing field '{name}'"
    if kind in _KINDS:
        return f"'{name}' must be {_KINDS[kind]}, got {got}"
    if kind in _BOUNDS:
        bound = next(iter(e["ctx"].values()))
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound  # ge=0, not 0.0
        return f"'{name}' must be {_BOUNDS[kind]} {show(bound)}, got {got}"
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
            checked_text(e["input"], f"messages[{key[1]}].{key[2]}" if len(key) == 3 else f"'{param}'")
    if param == "messages":
        return ApiError(_message_error(key, group), param=param)
    shape = _SHAPES[chat].get(param)
    if shape and group[0]["type"] != "missing":
        return ApiError(f"{shape}; got {show(group[0]['input'])}", param=param)
    name = ".".join(str(x) for x in group[0]["loc"])
    return ApiError(_field_error(name, group[0]), param=param)


def validated(body: dict, chat: bool) -> ChatCompletionRequest | CompletionRequest:
    """The body as its request model; ApiError (OpenAI's shape) for its first bad field."""
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        raise _from_pydantic(e, chat) from None


# What parsing knows of the served model --------------------------------------------
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
