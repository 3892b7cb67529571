"""A chat request's tools and response_format as this server serves them:
the format the answer's calls are parsed in (:func:`call_format`, with
serve.tools' fallback block where the template writes none), calls forced
by `tool_choice` (:func:`calls_forced`), and the constraining grammar's text
(:func:`request_grammar`: a forced call in the served format, or
response_format's JSON; :func:`special_markers` says which of its markers
are special tokens here). Every refusal an :class:`ApiError`."""

from __future__ import annotations

from ..engine import grammar
from ..errors import UserError
from . import tools as tools_fmt
from .openai_schema import ApiError, NamedToolChoice, ParseContext, show


def call_format(m, chat: bool, ctx: ParseContext) -> tuple[str | None, bool]:
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
    if calls_forced(m, chat):
        return tools_fmt.FALLBACK, True
    if m.tool_choice == "none":
        return None, False
    raise ApiError("'tools' is not supported for this model with tool_choice 'auto': its chat template writes no "
                   f"tool-call format this server parses ({', '.join(tools_fmt.FORMATS)}; serve --tool-call-parser "
                   "names one); tool_choice 'required' or a named function works without one",
                   param="tools", code="unsupported_parameter")


def calls_forced(m, chat: bool) -> bool:
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


def request_grammar(m, chat: bool, ctx: ParseContext, think: str | None = None, tool_format: str | None = None):
    """The constraining grammar's text or None: tool_choice `required` / a
    named function (the served tool-call format, arguments valid under each
    function's parameters), else response_format json_object / json_schema;
    with `think` (grammar.thinking) after the model's thinking."""
    choice = m.tool_choice if chat else None
    forced = calls_forced(m, chat)
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
                raise ApiError(f"'tool_choice' {show(choice if choice == 'required' else choice.model_dump())} "
                               "needs 'tools'", param="tool_choice")
            tools = [t.model_dump(exclude_none=True) for t in m.tools]
            name = None if choice == "required" else choice.function.name
            if name is not None and name not in [t["function"]["name"] for t in tools]:
                raise ApiError(f"'tool_choice' names function {show(name)}, which is not in 'tools'",
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

