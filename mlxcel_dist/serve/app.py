"""The HTTP side: an async FastAPI app on uvicorn (rank 0 only; it knows
nothing of ranks). A request is read within limits (size, time, JSON depth
and number length), parsed by `openai_api` off the event loop, and handed to
the scheduler as a Job whose events come back through an asyncio queue."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import openai_api as api
from . import openai_schema as schema
from . import reasoning, tools
from . import responses as rs
from . import responses_api as rapi
from .log import log
from .scheduler import SHUTDOWN_MESSAGE, Done, Failed, Job, Prompt, Scheduler, Text, Token

POLL_S = 0.25  # a waiting request checks that its client is still there this often
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this
DRAIN_TIMES = 16  # a body up to this many times the limit is read (and dropped) before the 413
COMPLETIONS = ("/v1/completions", "/completions")
CHAT = ("/v1/chat/completions", "/chat/completions")  # without /v1 too, as mlx-lm's server


@dataclass
class AppState:
    scheduler: Scheduler
    parse_ctx: "schema.ParseContext"
    pieces: "rs.TokenPieces"
    health: object  # lifecycle.Health: .status() -> (ok, reason)
    max_request_bytes: int = 1_000_000
    created: int = 0
    cluster: object = None  # () -> dict: GET /v1/cluster (lifecycle's view of the job); None: not served


def _error(e: "schema.ApiError", request: Request | None = None) -> JSONResponse:
    if request is not None:
        log(f"{_client(request)} {request.method} {request.url.path} {e.status}: {e.message}")
    return JSONResponse(e.body(), status_code=e.status)


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "-"


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        raise schema.ApiError("bad Content-Length")
    declared = None if length is None else int(length)
    if declared is not None and declared > DRAIN_TIMES * limit:  # not worth reading: the connection closes
        raise schema.ApiError(f"request body of {declared} bytes is over the limit of {limit}", status=413)
    parts, n = [], 0

    async def read():
        # A body somewhat over the limit is read to its end and dropped, so a
        # client still sending gets the 413 rather than a reset connection.
        nonlocal n
        async for chunk in request.stream():
            n += len(chunk)
            if n <= limit:
                parts.append(chunk)
            elif n > DRAIN_TIMES * limit:
                break
        if n > limit:
            raise schema.ApiError(f"request body of {declared or n} bytes is over the limit of {limit}", status=413)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except ClientDisconnect:
        raise schema.ApiError("the client left before its request body arrived", status=499) from None
    except asyncio.TimeoutError:
        raise schema.ApiError(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s", status=408) from None
    return b"".join(parts)


class _Mail:
    """Events from the scheduler's thread into the event loop: a step's
    events for every row arrive together, so they cross in one wake-up of
    the loop, not one per event."""

    def __init__(self):
        self.loop = None
        self.lock = threading.Lock()
        self.pending: list = []

    def post(self, queue: asyncio.Queue, ev) -> None:
        with self.lock:
            self.pending.append((queue, ev))
            first = len(self.pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            batch, self.pending = self.pending, []
        for queue, ev in batch:
            queue.put_nowait(ev)


def make_app(state: AppState) -> FastAPI:
    mail = _Mail()
    app = FastAPI(title="mlxcel-dist", description="OpenAI-compatible completions served by every rank together.",
                  version="0.1.0")
    sched = state.scheduler

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"no such endpoint: {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return _error(schema.ApiError(message, status=exc.status_code, type=kind), request)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):  # ours, not the client's: the one traceback
        log(f"{request.method} {request.url.path} 500: {type(exc).__name__}: {exc}\n"
            + "".join(traceback.format_exception(exc)))
        return JSONResponse(schema.ApiError(f"internal error: {type(exc).__name__}", status=500).body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        ok, reason = state.health.status()
        if ok:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "mlxcel-dist"}

    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(_page())

    @app.get("/v1/cluster")
    async def cluster():
        if state.cluster is None:
            return _error(schema.ApiError("no cluster view in this app", status=404, type="not_found_error"))
        return await run_in_threadpool(state.cluster)

    @app.get("/metrics")
    async def metrics():
        return Response(sched.metrics.render(sched.active, sched.waiting),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models():
        return {"object": "list", "data": [model_card(m) for m in state.parse_ctx.model_ids]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        if name not in state.parse_ctx.model_ids:
            return _error(schema.ApiError(f"The model `{name}` does not exist.", status=404, param="model",
                                       code="model_not_found"), request)
        return model_card(name)

    async def complete(request: Request, chat: bool, responses: bool = False):
        mail.loop = mail.loop or asyncio.get_running_loop()
        try:
            raw = await _read_body(request, state.max_request_bytes)
            body = await run_in_threadpool(schema.loads_limited, raw)
            if responses:  # the Responses API: the chat body it means (responses_api), echoed fields apart
                p, echo = await run_in_threadpool(rapi.parse, body, state.parse_ctx)
            else:
                p = await run_in_threadpool(api.parse, body, chat, state.parse_ctx)
            ok, reason = state.health.status()
            if not ok:
                raise schema.ApiError(f"the server is unavailable: {reason}", status=503)
        except schema.ApiError as e:
            return _error(e, request)
        events: asyncio.Queue = asyncio.Queue()
        job = Job(p.req, lambda ev: mail.post(events, ev), p.n, p.keep_special, p.prompts)
        if not sched.submit(job):
            return _error(schema.ApiError(SHUTDOWN_MESSAGE, status=503), request)
        if responses:
            feed = _Events(request, events)
            if p.stream:
                return StreamingResponse(rapi.stream(state, feed, job, p, echo, _StreamChoice(p)),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            return await rapi.whole(state, feed, job, p, echo)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if p.stream:
            return StreamingResponse(_stream(state, request, job, events, p, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(state, request, job, events, p, rid)

    @app.post("/v1/responses")
    @app.post("/responses", include_in_schema=False)
    async def responses(request: Request):
        return await complete(request, True, responses=True)

    async def tokens(request: Request, fn):
        try:
            body = await run_in_threadpool(schema.loads_limited, await _read_body(request, state.max_request_bytes))
            return await run_in_threadpool(fn, body, state.parse_ctx)
        except schema.ApiError as e:
            return _error(e, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):  # vLLM's
        return await tokens(request, rapi.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokens(request, rapi.detokenize)

    schemas = {True: schema.ChatCompletionRequest, False: schema.CompletionRequest}
    for chat, paths in ((False, COMPLETIONS), (True, CHAT)):
        extra = {"requestBody": {"required": True, "content": {
            "application/json": {"schema": schemas[chat].model_json_schema(ref_template="#/components/schemas/{model}")}}}}

        async def endpoint(request: Request, _chat=chat):
            return await complete(request, _chat)

        for i, path in enumerate(paths):
            app.add_api_route(path, endpoint, methods=["POST"], openapi_extra=extra, include_in_schema=i == 0,
                              name=("chat" if chat else "completion") + ("" if i == 0 else "_bare"))
    return app


@functools.cache
def _page() -> str:
    """The server's own page (package data: no network needed)."""
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


class _Events:
    """A job's events as they come; None once its client is gone, which is
    looked at every POLL_S also while events flow (a non-stream answer
    writes nothing until its end, so no failed write would tell)."""

    def __init__(self, request: Request, queue: asyncio.Queue):
        self.request, self.queue = request, queue
        self.checked = time.monotonic()

    async def next(self):
        while True:
            if time.monotonic() - self.checked >= POLL_S:
                self.checked = time.monotonic()
                if await self.request.is_disconnected():
                    return None
            if not self.queue.empty():
                return self.queue.get_nowait()
            try:
                return await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                pass


async def _whole(state: AppState, request: Request, job: Job, events: asyncio.Queue, p, rid: str) -> Response:
    parts = [[] for _ in range(p.choices)]
    entries = [[] for _ in range(p.choices)]
    done: dict = {}
    feed = _Events(request, events)
    try:
        while True:
            ev = await feed.next()
            if ev is None:
                return Response(status_code=499)
            if isinstance(ev, Token):
                entries[ev.index].append((ev.id, ev.logprob))
            elif isinstance(ev, Text):
                parts[ev.index].append(ev.text)
            elif isinstance(ev, Prompt):  # echo: the prompt's text and tokens lead the choice
                parts[ev.index].insert(0, state.parse_ctx.tokenizer.decode(ev.ids))
                entries[ev.index][:0] = rs.echo_entries(ev)
            elif isinstance(ev, Failed):
                return _error(schema.ApiError(ev.message, status=ev.status), request)
            elif isinstance(ev, Done):
                done[ev.index] = ev
                if len(done) < p.choices:
                    continue
                choices = [rs.whole_choice(p, i, "".join(parts[i]), done[i].finish_reason, entries[i], state.pieces)
                           for i in range(p.choices)]
                return JSONResponse(rs.whole_response(p, rid, int(time.time()), choices, p.prompt_tokens,
                                                      sum(d.completion_tokens for d in done.values())))
    finally:  # answered, or the client went away: an open job's row is freed
        state.scheduler.cancel(job)


class _StreamChoice:
    """One choice of a stream: its tokens whose logprobs ride on the next
    text chunk, the reasoning splitter (thinking apart from content) and the
    tool-call parser holding content that may be a call."""

    def __init__(self, p):
        self.pending, self.offset, self.completion_tokens = [], 0, 0
        self.calls = tools.StreamParser(p.tool_format, p.tools, p.forced) if p.tool_format is not None else None
        self.think = reasoning.Splitter(p.reasoning, p.thinking) if p.reasoning is not None else None

    def deltas(self, text: str, chat: bool, end: bool = False) -> list:
        """The deltas (chat) or texts (completions) for `text`; `end`: the
        answer is over (what the parsers held is let out)."""
        out = []
        if self.think is None:
            thought, content = "", text
        else:
            thought, content = self.think.finish() if end else self.think.feed(text)
        if thought:
            out.append({"reasoning_content": thought, "reasoning": thought})
        if self.calls is not None:
            content = self.calls.feed(content)
        if content:
            out.append({"content": content} if chat else content)
        return out


async def _stream(state: AppState, request: Request, job: Job, events: asyncio.Queue, p, rid: str):
    created = int(time.time())
    choices = [_StreamChoice(p) for _ in range(p.choices)]
    left = p.choices
    feed = _Events(request, events)

    def sse(obj) -> str:
        return "data: " + json.dumps(obj) + "\n\n"

    def chunk(i, delta_or_text, finish=None) -> str:
        c, lp = choices[i], None
        if p.req.logprobs is not None and c.pending:
            if p.chat:
                lp = rs.chat_logprobs(state.pieces, c.pending)
            else:
                lp, c.offset = rs.completion_logprobs(state.pieces, c.pending, c.offset)
            c.pending.clear()
        return sse(rs.stream_chunk(p, rid, created, delta_or_text, finish, lp, i))

    try:
        if p.chat:
            yield "".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(p.choices))
        ended = False
        while not ended:
            ev = await feed.next()
            if ev is None:
                return
            out = []
            while ev is not None:  # what has queued up meanwhile goes out in one write
                if isinstance(ev, Token):
                    choices[ev.index].pending.append((ev.id, ev.logprob))
                elif isinstance(ev, Prompt):  # echo: the prompt's text (and its tokens' logprobs) first
                    if p.req.logprobs is not None:
                        choices[ev.index].pending[:0] = rs.echo_entries(ev)
                    out.append(chunk(ev.index, state.parse_ctx.tokenizer.decode(ev.ids)))
                elif isinstance(ev, Text):
                    out += [chunk(ev.index, d) for d in choices[ev.index].deltas(ev.text, p.chat)]
                elif isinstance(ev, Failed):
                    out.append(sse(rs.stream_error(ev.message, ev.status)))
                    ended = True
                    break
                elif isinstance(ev, Done):
                    i, finish = ev.index, rs.FINISH.get(ev.finish_reason, "stop")
                    calls = choices[i].calls
                    if choices[i].think is not None:
                        out += [chunk(i, d) for d in choices[i].deltas("", p.chat, end=True)]
                    if calls is not None:  # the held text: content, or the calls (OpenAI's deltas)
                        rest, found = calls.finish()
                        if rest:
                            out.append(chunk(i, {"content": rest}))
                        out += [chunk(i, delta) for delta in rs.tool_call_deltas(found)]
                        finish = "tool_calls" if found and finish == "stop" else finish
                    out.append(chunk(i, {} if p.chat else "", finish))
                    choices[i].completion_tokens = ev.completion_tokens
                    left -= 1
                    if left == 0:
                        if p.include_usage:
                            out.append(sse(rs.usage_chunk(p, rid, created, p.prompt_tokens,
                                                          sum(c.completion_tokens for c in choices))))
                        ended = True
                        break
                ev = events.get_nowait() if not events.empty() else None
            if ended:
                out.append("data: [DONE]\n\n")
            if out:
                yield "".join(out)
    finally:  # done, or the client went away (the response task is cancelled): an open job's row is freed
        state.scheduler.cancel(job)
