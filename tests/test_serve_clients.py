"""What real client libraries send, through the real `openai` client against
the HTTP app in process over the embedded default model's BatchEngine (one
rank; the step protocol's loop on a thread): grammars llguidance would give
up on, nested tool schemas, forced calls on a template that writes no tool
format, several prompts in one completions request, the Responses API."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the answers ([test] extra)")
pytest.importorskip("llguidance", reason="constrained decoding needs llguidance ([test] / [grammar] extra)")

from mlxcel_dist.engine import grammar  # noqa: E402
from mlxcel_dist.checkpoint.loader import default_model_dir, read_config  # noqa: E402
from mlxcel_dist.serve.lifecycle import _template_formats  # noqa: E402
from mlxcel_dist.serve.openai_api import context_limit  # noqa: E402
from mlxcel_dist.serve.openai_schema import ParseContext  # noqa: E402
from mlxcel_dist.checkpoint.tokenizer import Tokenizer  # noqa: E402
from test_serve_tools import scripted_app  # noqa: E402

MSGS = [{"role": "user", "content": "The weather in Oslo"}]


def _app(vocab_limits=None):
    """(tokenizer, context, a scripted_app over the default model's BatchEngine
    and its grammar.Vocab, as in serve)."""
    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.checkpoint.loader import load_model

    d = default_model_dir()
    cfg = read_config(d)
    tok = Tokenizer(d, cfg)
    ctx = ParseContext(tokenizer=tok, vocab_size=cfg["vocab_size"], model_ids=("m",),
                       context_length=context_limit(cfg), **_template_formats(tok, None, None))
    vocab = grammar.Vocab(d / "tokenizer.json", cfg["vocab_size"], tok.eos_ids)
    return tok, ctx, scripted_app(tok, ctx, None, lambda: BatchEngine(load_model(d).model, vocab=vocab))


@pytest.fixture(scope="module")
def app():
    tok, ctx, server = _app()
    with server as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300), tok, ctx


def _optional(n: int, kind: str = "boolean") -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": kind} for i in range(n)}}


# ------------------------------------------------------------------ item 2: grammars llguidance gives up on
def test_a_schema_of_600_optional_properties_is_answered_whole(app):
    """llguidance's default row limit (2000 items, ~4 per optional property)
    gave up after `{`, which became EOS and "stop"; the raised limits serve it."""
    client, _, _ = app
    schema = _optional(600)
    rf = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
    stops = 0
    for seed in range(4):
        r = client.chat.completions.create(model="m", messages=MSGS, response_format=rf, temperature=1.0, seed=seed,
                                           max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "stop":
            stops += 1
            answer = json.loads(c.message.content)
            jsonschema.validate(answer, {**schema, "additionalProperties": False})
            assert c.message.content != "{"
    assert stops, "no answer ended within 200 tokens"


def test_forced_call_with_thousands_of_optional_parameters(app, monkeypatch):
    """As `serve --tool-call-parser hermes` on a template that leaves the
    tools out of the prompt (the default's: the fallback block would make a
    prompt of tens of thousands of tokens): 2500 optional parameters, whose
    row the default limit refused at its first key."""
    client, _, ctx = app
    monkeypatch.setattr(ctx, "tool_format", "hermes")
    wide = {"type": "function", "function": {"name": "configure", "parameters": _optional(2500)}}
    r = client.chat.completions.create(model="m", messages=MSGS, tools=[wide], tool_choice="required",
                                       temperature=1.0, seed=3, max_tokens=150, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length"), c
    if c.finish_reason == "tool_calls":
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), wide["function"]["parameters"])
    else:  # cut by max_tokens: no call markup left as content (item 6)
        assert "<tool_call>" not in (c.message.content or "")


def test_a_grammar_that_gives_up_mid_answer_is_an_error_not_stop(monkeypatch):
    """With llguidance's default limits (as before they were raised) the
    600-property schema gives up mid-answer: the ranks' masks allow only EOS
    then, and the engine names the row (`StepResult.gave_up`), so the
    request ends with an error naming the grammar, whole (400) and streamed (an error event),
    never content "{" with finish_reason "stop"."""
    import llguidance

    monkeypatch.setattr(grammar, "_limits", lambda: llguidance.LLParserLimits())
    tok, ctx, server = _app()
    rf = {"type": "json_schema", "json_schema": {"name": "wide", "schema": _optional(601)}}
    with server as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MSGS, response_format=rf, seed=1, max_tokens=50)
        assert "grammar" in str(e.value) and "llguidance" in str(e.value) and "max is 2000" in str(e.value)
        with pytest.raises(openai.APIError) as e:
            for _ in client.chat.completions.create(model="m", messages=MSGS, response_format=rf, seed=1,
                                                    max_tokens=50, stream=True):
                pass
        assert "grammar" in str(e.value) and "llguidance" in str(e.value)
        # the Responses API alike: a 400 whole, an error event then response.failed streamed
        fmt = {"format": {"type": "json_schema", "name": "wide", "schema": _optional(601)}}
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", input="x", text=fmt, max_output_tokens=50)
        assert "grammar" in str(e.value)
        events = list(client.responses.create(model="m", input="x", text=fmt, max_output_tokens=50, stream=True))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"] and "grammar" in events[-2].message
        assert events[-1].response.status == "failed" and "grammar" in events[-1].response.error.message
        # the server goes on: a plain request after it is answered
        r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4)
        assert r.choices[0].finish_reason == "length"


# ------------------------------------------------------------------ items 5 and 1: forced calls on any template
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"]}}}


def test_forced_calls_need_no_tool_call_parser(app):
    """The embedded default's template writes no tool format: tool_choice
    required / named render the tools into the prompt (a Hermes system block)
    and force a Hermes call, read back as tool_calls; auto is the one 400."""
    from mlxcel_dist.serve.openai_api import parse

    client, tok, ctx = app
    assert ctx.tool_format is None
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}, {"role": "user", "content": "And Rome?"}]
    prompt = tok.decode(parse({"messages": history, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 4},
                              True, ctx).req.prompt_ids)
    assert "<tools>" in prompt and "the weather in a city" in prompt  # the tools, rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\nrain, 4 C\n</tool_response>" in prompt  # the earlier call and its result
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_weather"}}] * 2):
        r = client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER], tool_choice=choice,
                                           temperature=1.0, seed=seed, max_tokens=100, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the call as OpenAI streams it, no content
    content, names, args, finish = "", [], "", None
    for ch in client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER], tool_choice="required",
                                             temperature=1.0, seed=7, max_tokens=100, stream=True,
                                             parallel_tool_calls=False):
        d = ch.choices[0].delta
        content += d.content or ""
        names += [tc.function.name for tc in d.tool_calls or [] if tc.function.name]
        args += "".join(tc.function.arguments or "" for tc in d.tool_calls or [])
        finish = ch.choices[0].finish_reason or finish
    assert content == "" and names == ["get_weather"] and finish == "tool_calls"
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    # tool_choice none: answered as text, the tools unused; auto: the 400 names the flag
    r = client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    for choice in ("auto", None):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER], max_tokens=5,
                                           **({"tool_choice": choice} if choice else {}))
        assert "--tool-call-parser" in str(e.value) and "'required'" in str(e.value)


def test_pydantic_nested_and_recursive_tools_through_the_client(app, monkeypatch):
    """The openai SDK's `pydantic_function_tool` (strict: $defs, refs,
    every property required): forced calls whose arguments the models
    themselves validate, nested and recursive (hermes, as --tool-call-parser
    would give on this template, which leaves the tools out of the prompt:
    two tools' block would not fit the toy model's 512-token context)."""
    from typing import Optional

    from pydantic import BaseModel, Field

    class Item(BaseModel):
        name: str = Field(max_length=6)
        qty: int = Field(ge=1, le=9)

    class Order(BaseModel):
        items: list[Item] = Field(max_length=2)

    class Node(BaseModel):
        value: int = Field(ge=0, le=9)
        left: Optional["Node"]

    client, _, ctx = app
    monkeypatch.setattr(ctx, "tool_format", "hermes")
    order, tree = openai.pydantic_function_tool(Order), openai.pydantic_function_tool(Node)
    assert "$defs" in order["function"]["parameters"] and "$defs" in tree["function"]["parameters"]
    ended = 0
    for seed in range(6):
        model, tool = (Order, order) if seed % 2 else (Node, tree)
        r = client.chat.completions.create(model="m", messages=MSGS, tools=[order, tree], temperature=1.0, seed=seed,
                                           tool_choice={"type": "function", "function": {"name": model.__name__}},
                                           max_tokens=200)
        c = r.choices[0]
        if c.finish_reason == "length":  # a deep tree may run past max_tokens: no call, no markup
            assert not c.message.tool_calls and not c.message.content, c
            continue
        ended += 1
        (call,) = c.message.tool_calls
        model.model_validate_json(call.function.arguments)
    assert ended >= 3, ended


# ------------------------------------------------------------------ item 6: a parallel call cut by max_tokens
def test_a_cut_second_call_leaves_no_markup_in_content():
    """required with parallel calls: the answer's second call is cut by
    max_tokens; the first is the call, the cut one is dropped (not content),
    finish_reason stays "length", whole and streamed."""
    d = default_model_dir()
    cfg = read_config(d)
    tok = Tokenizer(d, cfg)
    ctx = ParseContext(tokenizer=tok, vocab_size=cfg["vocab_size"], model_ids=("m",), tool_format="hermes")
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    answer = first + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    cut = len(tok.encode(first, add_special_tokens=False)) + 8  # inside the second call
    with scripted_app(tok, ctx, answer) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="m", messages=MSGS, tools=[WEATHER], tool_choice="required", max_tokens=cut)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "length" and c.message.content is None, c
        assert [json.loads(t.function.arguments) for t in c.message.tool_calls] == [{"city": "Oslo", "unit": "C"}]
        content, args, finish = "", "", None
        for ch in client.chat.completions.create(**kw, stream=True):
            content += ch.choices[0].delta.content or ""
            args += "".join(tc.function.arguments or "" for tc in ch.choices[0].delta.tool_calls or [])
            finish = ch.choices[0].finish_reason or finish
        assert content == "" and json.loads(args) == {"city": "Oslo", "unit": "C"} and finish == "length"
        # the only call cut: forced, so it is markup, not content
        c = client.chat.completions.create(**{**kw, "max_tokens": 6}).choices[0]
        assert c.finish_reason == "length" and not c.message.content and not c.message.tool_calls, c
        # auto: an answer cut inside its only call keeps its words (it may not be a call)
        c = client.chat.completions.create(**{**kw, "tool_choice": "auto", "max_tokens": 6}).choices[0]
        assert c.finish_reason == "length" and c.message.content == tok.decode(tok.encode(answer, add_special_tokens=False)[:6]), c


# ------------------------------------------------------------------ item 4: several prompts in one completions request
def test_a_list_of_prompts_is_one_choice_per_prompt_and_n(app):
    """Strings, id lists, a list of id lists: prompt p's n choices at
    indexes p * n .. p * n + n - 1, each what that prompt alone answers with
    the same seed (the rows batched together in the engine), usage summed;
    streamed alike. A single id list stays one prompt."""
    client, tok, _ = app
    texts = ["The sea", "A city by the sea is", "Numbers:"]
    kw = dict(model="m", max_tokens=6, temperature=1.0, seed=11)
    alone = [[c.text for c in client.completions.create(prompt=t, n=2, **kw).choices] for t in texts]
    r = client.completions.create(prompt=texts, n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for pair in alone for t in pair]
    ids = [tok.encode(t) for t in texts]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 6 * 6
    by_ids = client.completions.create(prompt=ids, n=2, **kw)
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices]
    one = client.completions.create(prompt=ids[1], **kw)  # a list of ids: one prompt
    assert len(one.choices) == 1 and one.choices[0].text == alone[1][0]
    streamed, usage = {}, None
    for ch in client.completions.create(prompt=texts, n=2, stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
        usage = ch.usage or usage
    assert [streamed[i] for i in range(6)] == [c.text for c in r.choices]
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == 36
    for bad, says in (([], "'prompt' must be"), ([[]], "'prompt' must be"), ([[5], [10**6]], "'prompt'[1]"),
                      (["a"] * 1025, "at most 1024")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=bad, **kw)
        assert says in str(e.value), e.value


# ------------------------------------------------------------------ item 8: the Responses API, /tokenize, /detokenize
def test_responses_whole_and_streamed(app):
    """client.responses.create: a string input with instructions, whole
    and streamed (the same answer: the same seed), usage, max_output_tokens
    cutting it (status incomplete), text.format json_schema."""
    client, tok, _ = app
    kw = dict(model="m", instructions="Answer briefly.", input="The sea", temperature=1.0,
              max_output_tokens=8, extra_body={"seed": 4})
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and r.output_text == msg.content[0].text
    chat = client.chat.completions.create(model="m", messages=[{"role": "system", "content": "Answer briefly."},
                                                               {"role": "user", "content": "The sea"}],
                                          temperature=1.0, max_tokens=8, seed=4)
    assert r.output_text == chat.choices[0].message.content  # the same path as chat completions
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 8
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == 8
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
              "required": ["ok", "n"]}
    r = client.responses.create(model="m", input=[{"role": "user", "content": "Is it?"}], max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "yn", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), {**schema, "additionalProperties": False})


def test_responses_function_tools_round_trip(app):
    """Function tools as openai-agents sends them (strict, tool_choice
    required): a function_call item, then the conversation sent back with
    the call and its function_call_output item; streamed calls as
    output_item / function_call_arguments events; auto without a format
    and stored state are clear 400s."""
    client, _, _ = app
    tool = {"type": "function", "name": "get_weather", "description": "the weather in a city", "strict": True,
            "parameters": {**WEATHER["function"]["parameters"], "additionalProperties": False}}
    first = client.responses.create(model="m", input="Weather in Oslo?", tools=[tool], tool_choice="required",
                                    parallel_tool_calls=False, temperature=1.0, max_output_tokens=100)
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    follow = [{"role": "user", "content": "Weather in Oslo?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "rain, 4 C"}]
    r = client.responses.create(model="m", input=follow, tools=[tool], tool_choice="none", max_output_tokens=5)
    assert r.output[0].type == "message" and r.status == "incomplete"
    events = list(client.responses.create(model="m", input="Weather?", tools=[tool], parallel_tool_calls=False,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=100, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call"] and events[-1].type == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == done[0].arguments == events[-1].response.output[0].arguments
    for bad, says in ((dict(tools=[tool]), "--tool-call-parser"), (dict(previous_response_id="resp_1"), "stored"),
                      (dict(tools=[{"type": "web_search"}]), "only function tools"),
                      (dict(input=[{"type": "image_generation_call"}]), "not supported"),
                      (dict(max_output_tokens=10**6), "'max_output_tokens' must be <=")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "m", "input": "x", **bad})
        assert says in str(e.value), e.value


def test_tokenize_and_detokenize(app):
    client, tok, ctx = app
    base = str(client.base_url).removesuffix("/v1/")
    t = client.post(base + "/tokenize", body={"prompt": "The sea is calm", "return_token_strs": True}, cast_to=object)
    assert t["tokens"] == tok.encode("The sea is calm") and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == ctx.context_length and "".join(t["token_strs"][1:]) == "The sea is calm"
    bare = client.post(base + "/tokenize", body={"prompt": "The sea", "add_special_tokens": False}, cast_to=object)
    assert bare["tokens"] == tok.encode("The sea", add_special_tokens=False) and bare["token_strs"] is None
    chat = client.post(base + "/tokenize", body={"messages": MSGS}, cast_to=object)
    from mlxcel_dist.serve.openai_api import parse

    assert chat["tokens"] == parse({"messages": MSGS, "max_tokens": 1}, True, ctx).req.prompt_ids  # as chat renders
    assert chat["count"] == client.chat.completions.create(model="m", messages=MSGS, max_tokens=1).usage.prompt_tokens
    d = client.post(base + "/detokenize", body={"tokens": t["tokens"]}, cast_to=object)
    assert d == {"prompt": tok.decode(t["tokens"])}
    for path, body in (("/detokenize", {"tokens": [10**9]}), ("/tokenize", {}), ("/tokenize", {"prompt": 5})):
        with pytest.raises(openai.BadRequestError):
            client.post(base + path, body=body, cast_to=object)


def test_responses_stream_puts_thinking_in_a_reasoning_item():
    """A thinking answer streamed: a reasoning item (reasoning_text deltas)
    closed before the message item opens; the final response lists both."""
    import asyncio
    from types import SimpleNamespace

    from mlxcel_dist.serve import responses_api as rapi
    from mlxcel_dist.serve.app import _StreamChoice
    from mlxcel_dist.serve.scheduler import Done, Text

    p = SimpleNamespace(tool_format=None, tools=None, forced=False, reasoning="qwen3", thinking=True, model="m",
                        prompt_tokens=3)

    class Feed:
        evs = [Text("Hm, the sea"), Text(".</think>\n\nCalm"), Text(" today."), Done("eos", 3, 5)]

        async def next(self):
            return self.evs.pop(0)

    state = SimpleNamespace(scheduler=SimpleNamespace(cancel=lambda job: None))

    async def run():
        return [x async for x in rapi.stream(state, Feed(), None, p, {}, _StreamChoice(p))]

    events = [json.loads(e.split("data: ", 1)[1]) for chunk in asyncio.run(run()) for e in chunk.split("\n\n") if e]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Hm, the sea."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Calm today."
    final = events[-1]
    assert final["type"] == "response.completed" and [i["type"] for i in final["response"]["output"]] == [
        "reasoning", "message"]
    assert final["response"]["usage"]["output_tokens"] == 5


def test_openai_agents_function_tool_with_a_model_parameter(app, monkeypatch):
    """openai-agents (optional: skipped when absent) drives the server through
    its Responses model and its Chat Completions model, whole and streamed: a
    function_tool whose parameter is a pydantic model ($defs / $ref), forced
    (tool_choice required), its output the run's final output (hermes, as
    `--tool-call-parser hermes` gives: the later turns are `auto`)."""
    import asyncio
    import importlib.metadata

    try:
        importlib.metadata.version("openai-agents")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("openai-agents is not installed (optional)")
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from pydantic import BaseModel, Field

    class Place(BaseModel):
        city: str = Field(max_length=8)
        country: str = Field(max_length=8)

    calls = []

    def get_weather(place: Place) -> str:
        """The weather at a place."""
        calls.append(place)
        return "rain, 4 C"

    get_weather.__annotations__ = {"place": Place, "return": str}  # the class, not this module's string
    get_weather = function_tool(get_weather)

    set_tracing_disabled(True)  # no traces sent anywhere
    client, _, ctx = app
    monkeypatch.setattr(ctx, "tool_format", "hermes")
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=250, temperature=1.0)

    async def run(kind, streamed: bool):
        model = kind(model="m", openai_client=openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused",
                                                                 max_retries=0))
        agent = Agent(name="a", instructions="Be brief.", tools=[get_weather], model=model, model_settings=settings,
                      tool_use_behavior="stop_on_first_tool")
        if not streamed:
            return (await Runner.run(agent, "Weather in Oslo?", max_turns=2)).final_output
        res = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=2)
        async for _ in res.stream_events():
            pass
        return res.final_output

    for kind in (OpenAIResponsesModel, OpenAIChatCompletionsModel):
        for streamed in (False, True):
            calls.clear()
            assert asyncio.run(run(kind, streamed)) == "rain, 4 C"
            assert len(calls) == 1 and isinstance(calls[0], Place)
