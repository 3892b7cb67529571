"""OpenAI's Responses API (`POST /v1/responses`) and vLLM's `/tokenize` and
`/detokenize`, on the chat path: a Responses body is read into the chat
completions body it means (`to_chat`: instructions as the system message,
input items as messages, function_call / function_call_output items as an
assistant's tool calls and tool messages, `text.format` as
`response_format`, `max_output_tokens` as `max_completion_tokens`), parsed
by openai_api.parse and run by the same scheduler; the answer comes back
as Responses output items (reasoning, message, function_call), whole or as
its stream of typed events. No state is kept: `previous_response_id` and
`background` are refused."""

from __future__ import annotations

import json
import time
import uuid

from fastapi.responses import JSONResponse, Response

from . import openai_api as api
from . import openai_schema as schema
from . import responses as rs
from .scheduler import Done, Failed, Text

# Fields passed to the chat body as they are (the sampling ones, vLLM's extras);
# the rest of a body (store, metadata, user, include, ...) has no effect here.
PASSED = ("temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "logit_bias", "stop", "chat_template_kwargs", "speculative")
UNSUPPORTED = {"previous_response_id": "no responses are stored: send the whole conversation as 'input'",
               "conversation": "no conversations are stored: send the whole conversation as 'input'",
               "background": "responses run in the foreground only", "prompt": "no stored prompts"}
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


def _bad(message: str, param: str | None = None, code: str | None = None) -> schema.ApiError:
    return schema.ApiError(message, param=param, code=code)


def _text(content, where: str) -> str:
    """A content field (a string or a list of text parts) as text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", "input")
    out = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{where}: only text parts are supported, got {schema.show(kind)}", "input",
                       "unsupported_parameter")
        out.append(part["text"])
    return "".join(out)


def _messages(body: dict) -> list:
    """instructions and input as chat messages."""
    out = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant", "input")
            out.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(f"{where}: a function_call item needs string 'call_id', 'name' and 'arguments'", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not last["content"] and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: a function_call_output item needs a string 'call_id'", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":  # an earlier answer's thinking: templates drop it from the history
            continue
        else:
            raise _bad(f"{where}: input items of type {schema.show(kind)} are not supported (message, function_call, "
                       "function_call_output)", "input", "unsupported_parameter")
    return out


def _tools(body: dict) -> dict:
    """tools and tool_choice in the chat form."""
    out = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise _bad(f"tools[{i}]: only function tools are supported, got {schema.show(kind)}", "tools",
                           "unsupported_parameter")
            out["tools"].append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice", "unsupported_parameter")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: dict) -> dict:
    """text.format as response_format."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("'text.format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}", "text")
    if fmt["type"] != "json_schema":
        return {"response_format": {"type": fmt["type"]}}
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def to_chat(body: dict) -> dict:
    """The chat completions body a Responses body means."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise _bad(f"'{name}' is not supported by this server: {why}", name, "unsupported_parameter")
    chat = {"messages": _messages(body), **_tools(body), **_format(body)}
    chat.update({k: body[k] for k in PASSED if k in body})
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("stream"):
        chat["stream"] = True
    return chat


def parse(body: object, ctx: schema.ParseContext) -> tuple[api.Parsed, dict]:
    """(the chat Parsed, the request's fields the response echoes)."""
    chat = to_chat(body)
    try:
        p = api.parse(chat, True, ctx)
    except schema.ApiError as e:  # the chat field's name is the Responses one here
        e.param = CHAT_PARAMS.get(e.param, e.param)
        e.message = e.message.replace("'max_completion_tokens'", "'max_output_tokens'")
        raise
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "metadata", "previous_response_id",
                                      "reasoning", "user")}
    echo.update(temperature=p.req.sampling.temp, top_p=p.req.sampling.top_p, tools=body.get("tools") or [],
                tool_choice=body.get("tool_choice") or "auto", parallel_tool_calls=body.get("parallel_tool_calls", True),
                text=body.get("text") or {"format": {"type": "text"}}, store=False, truncation="disabled")
    return p, echo


# Answers ---------------------------------------------------------------------
def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs_"), "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": _id("fc_"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def _response(rid: str, created: int, p: api.Parsed, echo: dict, status: str, output: list, usage=None,
              incomplete: bool = False, error: dict | None = None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": p.model,
            "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, **echo,
            "usage": usage}


def _usage(p: api.Parsed, completion_tokens: int) -> dict:
    return {"input_tokens": p.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": p.prompt_tokens + completion_tokens}


async def whole(state, feed, job, p: api.Parsed, echo: dict) -> Response:
    """The non-streamed response: the answer's output items in order."""
    parts, entries = [], []
    try:
        while True:
            ev = await feed.next()
            if ev is None:
                return Response(status_code=499)
            if isinstance(ev, Text):
                parts.append(ev.text)
            elif isinstance(ev, Failed):
                return JSONResponse(schema.ApiError(ev.message, status=ev.status).body(), status_code=ev.status)
            elif isinstance(ev, Done):
                msg = rs.whole_choice(p, 0, "".join(parts), ev.finish_reason, entries, state.pieces)["message"]
                output = ([_reasoning_item(msg["reasoning_content"])] if msg.get("reasoning_content") else [])
                if msg.get("content") or not msg.get("tool_calls"):
                    output.append(_message_item(msg.get("content") or ""))
                output += [_call_item(c) for c in msg.get("tool_calls") or []]
                cut = ev.finish_reason == "length"
                return JSONResponse(_response(_id("resp_"), int(time.time()), p, echo,
                                              "incomplete" if cut else "completed", output,
                                              _usage(p, ev.completion_tokens), cut))
    finally:
        state.scheduler.cancel(job)


class _Events:
    """A stream's typed events, numbered, and the output items as they open and close."""

    def __init__(self):
        self.seq, self.output, self.open = 0, [], None  # open: (item, its text so far)

    def __call__(self, kind: str, **fields) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj)}\n\n"

    def text(self, kind: str, delta: str) -> list:
        """`delta` of a reasoning or a message item (opened first, the other closed)."""
        out = []
        if self.open is not None and self.open[0]["type"] != kind:
            out += self.close()
        if self.open is None:
            item = _reasoning_item("") if kind == "reasoning" else _message_item("", "in_progress")
            part = item["content"][0]
            item = {**item, "status": "in_progress", "content": []}
            self.open = (item, "")
            at = len(self.output)
            out += [self("response.output_item.added", output_index=at, item=item),
                    self("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                         part=part)]
        item, text = self.open
        self.open = (item, text + delta)
        kind_delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self(kind_delta, item_id=item["id"], output_index=len(self.output), content_index=0,
                           delta=delta, **extra)]

    def close(self) -> list:
        if self.open is None:
            return []
        item, text = self.open
        self.open, at = None, len(self.output)
        done = (_reasoning_item(text) if item["type"] == "reasoning" else _message_item(text)) | {"id": item["id"]}
        part = done["content"][0]
        kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        self.output.append(done)
        return [self(kind, item_id=item["id"], output_index=at, content_index=0, text=text, **extra),
                self("response.content_part.done", item_id=item["id"], output_index=at, content_index=0, part=part),
                self("response.output_item.done", output_index=at, item=done)]

    def call(self, call: dict) -> list:
        item = _call_item(call)
        at = len(self.output)
        self.output.append(item)
        return [self("response.output_item.added", output_index=at,
                     item={**item, "arguments": "", "status": "in_progress"}),
                self("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                     delta=item["arguments"]),
                self("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                     name=item["name"], arguments=item["arguments"]),
                self("response.output_item.done", output_index=at, item=item)]


async def stream(state, feed, job, p: api.Parsed, echo: dict, choice):
    """The streamed response: response.created / in_progress, each output
    item's added / delta / done events, then response.completed (or
    incomplete, cut by max_output_tokens; failed after an `error` event).
    `choice`: app's per-choice splitter (thinking, content, held calls)."""
    rid, created, ev_ = _id("resp_"), int(time.time()), _Events()
    head = _response(rid, created, p, echo, "in_progress", [])
    try:
        yield ev_("response.created", response=head) + ev_("response.in_progress", response=head)
        while True:
            ev = await feed.next()
            if ev is None:
                return
            out = []
            if isinstance(ev, Text):
                for d in choice.deltas(ev.text, True):
                    out += ev_.text("reasoning" if "reasoning_content" in d else "message",
                                    d.get("reasoning_content") or d.get("content"))
            elif isinstance(ev, Failed):
                code = rs.stream_error(ev.message, ev.status)["error"]["code"]
                yield "".join(out) + ev_("error", code=code, message=ev.message, param=None) + ev_(
                    "response.failed", response=_response(rid, created, p, echo, "failed", ev_.output,
                                                          error={"code": code, "message": ev.message}))
                return
            elif isinstance(ev, Done):
                for d in choice.deltas("", True, end=True):
                    out += ev_.text("reasoning" if "reasoning_content" in d else "message",
                                    d.get("reasoning_content") or d.get("content"))
                rest, calls = choice.calls.finish() if choice.calls is not None else ("", [])
                if rest:
                    out += ev_.text("message", rest)
                if not calls and not any(i["type"] == "message" for i in ev_.output) and (
                        ev_.open is None or ev_.open[0]["type"] != "message"):
                    out += ev_.text("message", "")  # an empty answer is still a message
                out += ev_.close()
                for c in calls:
                    out += ev_.call(c)
                cut = ev.finish_reason == "length"
                final = _response(rid, created, p, echo, "incomplete" if cut else "completed", ev_.output,
                                  _usage(p, ev.completion_tokens), cut)
                yield "".join(out) + ev_("response.incomplete" if cut else "response.completed", response=final)
                return
            if out:
                yield "".join(out)
    finally:
        state.scheduler.cancel(job)


# vLLM's /tokenize and /detokenize ---------------------------------------------
def tokenize(body: object, ctx: schema.ParseContext) -> dict:
    """{prompt | messages, add_special_tokens, return_token_strs, ...} ->
    {count, max_model_len, tokens, token_strs} (vLLM's shapes)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    api.served_model(body.get("model"), ctx)
    if "messages" in body:
        if body.get("add_generation_prompt", True) is not True or body.get("continue_final_message"):
            raise _bad("only add_generation_prompt true is supported", "add_generation_prompt",
                       "unsupported_parameter")
        chat = {k: body[k] for k in ("messages", "tools", "tool_choice", "chat_template_kwargs") if k in body}
        ids = api.parse({**chat, "max_tokens": 1}, True, ctx).req.prompt_ids
    elif isinstance(body.get("prompt"), str):
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise _bad("'add_special_tokens' must be true or false", "add_special_tokens")
        schema.checked_text(body["prompt"], "'prompt'")
        ids = ctx.tokenizer.encode(body["prompt"], add_special_tokens=special)
    else:
        raise _bad("send 'prompt' (a string) or 'messages'", "prompt")
    strs = [rs.TokenPieces(ctx.tokenizer)(t)[0] for t in ids] if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": ctx.context_length, "tokens": ids, "token_strs": strs}


def detokenize(body: object, ctx: schema.ParseContext) -> dict:
    """{tokens} -> {prompt}."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    api.served_model(body.get("model"), ctx)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < ctx.vocab_size for t in ids):
        raise _bad(f"'tokens' must be a list of token ids in [0, {ctx.vocab_size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(ids)}
