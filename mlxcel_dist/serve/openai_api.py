"""OpenAI's request bodies: parsed and checked (responses.py builds the answers).

Pure functions, no I/O: the HTTP app reads a body with
openai_schema.loads_limited and turns it into a :class:`Parsed` with
:func:`parse` (every refusal an openai_schema.ApiError shaped as OpenAI's
errors). The pydantic models (openai_schema) check the shapes; what depends
on the served model (its vocabulary, context, cap, template) is checked here
after them, against an openai_schema.ParseContext; tools and
response_format become the served format and grammar in constrain.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..engine import grammar
from ..errors import UserError
from ..engine.sampling import SamplingParams
from . import reasoning
from . import tools as tools_fmt
from .constrain import call_format, calls_forced, request_grammar
from .openai_schema import (
    DEFAULT_CHAT_TOKENS, DEFAULT_COMPLETION_TOKENS, MAX_TOP_LOGPROBS, ApiError, ChatCompletionRequest,
    CompletionRequest, Defaults, ParseContext, checked_text, show, validated,
)
from .wire import GenRequest, check_wire


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
            raise ApiError(f"'{name}' is not supported by this server: {why}; got {show(body[name])}",
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
        raise ApiError(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {show(lp)}", param="logprobs")
    return lp


def _encode(ctx: ParseContext, text: str, where: str) -> list[int]:
    checked_text(text, where)
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
                raise ApiError(f"token id {show(bad[0])} in {where} is outside the vocabulary [0, {ctx.vocab_size})",
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
        entry = {"role": msg.role, "content": checked_text(c, f"messages[{i}].content")}
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
                           f"{', '.join(RESERVED_TEMPLATE_VARS)}; got {show(key)}", param="chat_template_kwargs")
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


def _max_tokens(m, chat: bool, n_prompt: int, ctx: ParseContext) -> int:
    """The client's number (<= the cap) or the default, then the context check
    (a default, not the client's number, shrinks to what fits)."""
    name = "max_completion_tokens" if chat and m.max_completion_tokens is not None else "max_tokens"
    asked = getattr(m, name)
    cap = ctx.max_tokens_cap
    if asked is not None and asked > cap:
        raise ApiError(f"'{name}' must be <= {cap}, got {show(asked)}", param=name)
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
            raise ApiError(f"'logit_bias' keys must be token ids in [0, {vocab}), got {show(key)}",
                           param="logit_bias")
        if not -100.0 <= value <= 100.0 or value != value:
            raise ApiError(f"'logit_bias' values must be in [-100, 100], got {show(value)} for token {key}",
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


def served_model(asked: str | None, ctx: ParseContext) -> str:
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
    m = validated(body, chat)
    model = served_model(m.model, ctx)
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
    tool_format, fallback = call_format(m, chat, ctx)
    if chat:
        ids, text = _chat_ids(m, ctx, fallback)
        prompts = [ids]
    else:
        prompts, text = _completion_ids(m, ctx), ""
        ids = prompts[0]
    stops = [checked_text(s, "'stop'") for s in ([m.stop] if isinstance(m.stop, str) else m.stop or [])]
    stop_ids = list(m.stop_token_ids or [])
    if any(t >= ctx.vocab_size for t in stop_ids):
        raise ApiError(f"'stop_token_ids' must be token ids in [0, {ctx.vocab_size})", param="stop_token_ids")
    fmt = ctx.reasoning_format if chat and not ctx.plain_chat else None
    if tool_format == "harmony" and fmt is None:  # harmony's calls are messages: the channels split first
        fmt = "gpt_oss"
    # a constrained answer's grammar lets the model think first (its thinking split off as usual)
    gram = request_grammar(m, chat, ctx, grammar.thinking(fmt, text), tool_format)
    longest = max(prompts, key=len)  # every prompt must fit with max_tokens
    echo = bool(not chat and m.echo)
    if chat and body.get("echo"):
        raise ApiError("'echo' is not supported by this server for chat: a completions field (chat answers never "
                       f"repeat the messages); got {show(body['echo'])}", param="echo", code="unsupported_parameter")
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
                  calls_forced(m, chat) and tool_format is not None, prompts if len(prompts) > 1 else None, echo)


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
