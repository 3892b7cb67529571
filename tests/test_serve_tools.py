"""Tool calls: the formats' parsers (whole and streamed), the template
rendering of tools and of earlier calls, and the real `openai` client against
the HTTP app, in process, whose engine is scripted to answer with a call."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

from mlxcel_dist.checkpoint.loader import default_model_dir, read_config
from mlxcel_dist.serve import tools
from mlxcel_dist.serve.openai_api import parse
from mlxcel_dist.serve.openai_schema import ApiError, ParseContext
from mlxcel_dist.checkpoint.tokenizer import Tokenizer

# A Qwen-style template (hermes calls), reduced: tools in the system turn,
# an assistant's calls as <tool_call> blocks, tool results as user turns.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _args(call) -> dict:
    return json.loads(call["function"]["arguments"])


def test_hermes_calls_and_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = tools.parse("hermes", text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert _args(calls[0]) == {"city": "Paris"} and _args(calls[1]) == {}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # not a call: left as the model's words
    assert tools.parse("hermes", "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert tools.parse("hermes", "plain words") == ("plain words", [])


def test_llama3_json_and_mistral_calls():
    content, calls = tools.parse("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
                                                '{"name": "g", "parameters": {}}')
    assert content == "" and [c["function"]["name"] for c in calls] == ["f", "g"] and _args(calls[0]) == {"x": 1}
    assert tools.parse("llama3_json", "{not a call") == ("{not a call", [])
    assert tools.parse("llama3_json", '{"no": "name"}') == ('{"no": "name"}', [])
    content, calls = tools.parse("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": "b"}}]')
    assert content == "Sure." and _args(calls[0]) == {"a": "b"}
    content, calls = tools.parse("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}')
    assert [c["function"]["name"] for c in calls] == ["f", "g"] and _args(calls[0]) == {"a": 1}


# The formats of DeepSeek, GLM-4.5, Kimi K2, MiniMax-M2 and gpt-oss, as their
# chat templates write earlier calls (and their models answer).
DS_V3 = ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
         '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
          '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
GLM = ('Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n'
       '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>')
KIMI = ('Let me see.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
MINIMAX = ('On it.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
           '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>')
HARMONY = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>'
HARMONY_RAW = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
               '{"city": "Paris"}')
TYPED = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.mark.parametrize("fmt,text,content,calls", [
    ("deepseek_v3", DS_V3, "Sure.", [("get_weather", {"city": "Paris"})]),
    ("deepseek_v31", DS_V31, "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("glm45", GLM, "Checking.", [("get_weather", {"city": "42", "days": 3})]),  # the schema says city is a string
    ("kimi_k2", KIMI, "Let me see.", [("get_weather", {"city": "Paris"})]),
    ("minimax_m2", MINIMAX, "On it.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("harmony", HARMONY, "", [("get_weather", {"city": "Paris"})]),
    ("harmony", HARMONY_RAW, "", [("get_weather", {"city": "Paris"})]),
])
def test_more_formats_whole(fmt, text, content, calls):
    got_content, got = tools.parse(fmt, text, TYPED)
    assert got_content == content
    assert [(c["function"]["name"], _args(c)) for c in got] == calls
    assert tools.parse(fmt, "just words", TYPED) == ("just words", [])
    untyped = tools.parse(fmt, text)[1]  # no schema: a value that parses as JSON is JSON
    assert [c["function"]["name"] for c in untyped] == [name for name, _ in calls]


@pytest.mark.parametrize("fmt,text", [
    ("hermes", 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("deepseek_v3", DS_V3), ("deepseek_v3", DS_V31), ("glm45", GLM), ("kimi_k2", KIMI), ("minimax_m2", MINIMAX),
    ("harmony", "Preamble. " + HARMONY), ("deepseek_v3", "<｜tool▁calls not quite"), ("kimi_k2", "<|tool_ words"),
    ("hermes", 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("hermes", "no call here, only <tool text"),
    ("llama3_json", '  {"name": "f", "parameters": {"q": "<tool_call>"}}'),
    ("llama3_json", "An answer in words."),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {}}]'),
    ("mistral", "[TOOL_CALL but not quite"),
])
def test_streamed_parse_equals_the_whole_parse_at_every_split(fmt, text):
    whole = tools.parse(fmt, text, TYPED)
    # every two-part cut, and one character at a time
    for parts in [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]:
        sp = tools.StreamParser(fmt, TYPED)
        sent = "".join(sp.feed(p) for p in parts)
        rest, calls = sp.finish()
        assert [c["function"] for c in calls] == [c["function"] for c in whole[1]], parts
        if whole[1]:
            assert (sent + rest).strip() == whole[0]
        else:
            assert sent + rest == text


# Each family's template, reduced to the lines that carry its markers (the
# real ones: DeepSeek-R1's and V3.1's, GLM-4.5's, Kimi-K2-Thinking's, MiniMax-M2's,
# gpt-oss's chat_template.jinja).
FAMILY_TEMPLATES = {
    "deepseek_v3": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
                   "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']}}",
    "deepseek_v31": "{% for tool in message['tool_calls'] %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
                   "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + "
                   "'<｜tool▁call▁end｜>'}}{% endfor %}{{'<｜Assistant｜>'}}{{'</think>'}}",
    "glm45": "{%- if tools -%}<|system|>\n# Tools\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
             "<arg_value>{arg-value-1}</arg_value>\n</tool_call>{%- endif -%}<|assistant|>\n<think></think>",
    "kimi_k2": "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson() }}<|im_end|>{%- endif -%}"
               "<|tool_calls_section_begin|><|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>"
               "<think></think>",
    "minimax_m2": "{%- set toolcall_begin_token = '<minimax:tool_call>' -%}{%- if tools -%}# Tools{%- endif -%}"
                  "{{- ']~b]ai' ~ '\n' ~ '<think>' ~ '\n' }}{{- '</think>' }}",
    "harmony": '{%- if tools -%}namespace functions {%- endif -%}{{- "<|start|>assistant to=" }}'
               '{{- "functions." + name + "<|channel|>commentary " }}json<|message|>{{ args }}{{- "<|call|>" }}'
               '<|start|>assistant<|channel|>analysis<|message|>',
}


@pytest.mark.parametrize("fmt", sorted(FAMILY_TEMPLATES))
def test_each_family_template_is_detected(fmt):
    assert tools.detect(FAMILY_TEMPLATES[fmt]) == fmt


def test_detect_and_the_template_renders_tools_and_calls():
    assert tools.detect(HERMES_TEMPLATE) == "hermes"
    assert tools.detect("{{ messages }}") is None
    assert tools.detect("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    d = default_model_dir()
    tok = Tokenizer(d, read_config(d), chat_template=HERMES_TEMPLATE)
    ctx = ParseContext(tokenizer=tok, vocab_size=read_config(d)["vocab_size"], model_ids=("m",), tool_format="hermes")
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
            "tools": [WEATHER], "max_tokens": 8}
    p = parse(body, True, ctx)
    text = tok.decode(p.req.prompt_ids)
    assert '"name": "get_weather"' in text and "the weather in a city" in text  # the tool, rendered
    assert '"arguments": {"city": "Paris"}' in text  # the earlier call, arguments as an object
    assert "sunny, 21 C" in text and p.tool_format == "hermes"
    assert parse({**body, "tool_choice": "none"}, True, ctx).tool_format is None  # rendered, never parsed
    # required / named: constrained decoding's grammar travels with the request, the answer is parsed
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        p = parse({**body, "tool_choice": choice}, True, ctx)
        assert p.req.grammar and p.tool_format == "hermes"
    for bad, match in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
                       ({"tool_choice": "required", "tools": []}, "needs 'tools'")]:
        with pytest.raises(ApiError, match=match) as e:
            parse({**body, **bad}, True, ctx)
        assert e.value.param == "tool_choice"
    bad_args = json.loads(json.dumps(body))
    bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ApiError, match="arguments is not JSON"):
        parse(bad_args, True, ctx)
    plain = ParseContext(tokenizer=tok, vocab_size=ctx.vocab_size, model_ids=("m",))  # no format known
    with pytest.raises(ApiError) as e:
        parse(body, True, plain)
    assert e.value.param == "tools" and "'tools' is not supported" in e.value.message
    # forced calls need no format: the tools as a Hermes block, the call parsed as Hermes'; none: not rendered
    for ctx_ in (plain, ParseContext(tokenizer=tok, vocab_size=ctx.vocab_size, model_ids=("m",), plain_chat=True)):
        p = parse({**body, "tool_choice": "required"}, True, ctx_)
        assert p.tool_format == "hermes" and p.forced and p.req.grammar
        assert "<tools>" in tok.decode(p.req.prompt_ids) and "<tool_response>" in tok.decode(p.req.prompt_ids)
        p = parse({**body, "tool_choice": "none"}, True, ctx_)
        assert p.tool_format is None and "<tools>" not in tok.decode(p.req.prompt_ids)


# --------------------------------------------------------------------------- the app, in process
class ScriptedEngine:
    """BatchEngine's calls; every row answers with `answer`'s ids, then EOS."""

    prefilling = False
    prefilled = 0
    flat_steps = traces = micro_steps = 0

    def __init__(self, ids, eos):
        self.ids, self.eos = list(ids) + [eos], eos
        self.rows, self.want, self.logprobs, self.failed = {}, {}, {}, {}
        self.prompt_logprobs = {}

    def __contains__(self, rid):
        return rid in self.rows

    def add_many(self, items):
        for rid, *_ in items:
            self.rows[rid] = 0

    def remove(self, rid):
        self.rows.pop(rid)

    def step(self, prefill=None, micro=0):
        out = {}
        for rid, n in self.rows.items():
            out[rid] = self.ids[min(n, len(self.ids) - 1)]
            self.rows[rid] = n + 1
        return out


@contextlib.contextmanager
def scripted_app(tok, ctx, answer: str | None, make_engine=None):
    """The HTTP app in process over a ScriptedEngine answering `answer` to
    every request, or over the engine `make_engine()` builds on the loop's
    thread (MLX streams are per thread) (one rank: the step protocol's loop
    on a thread); yields the base URL."""
    import uvicorn

    from mlxcel_dist.serve import responses as rs
    from mlxcel_dist.serve.app import AppState, make_app
    from mlxcel_dist.serve.protocol import advance
    from mlxcel_dist.serve.scheduler import Scheduler
    from test_serve_steps import Guard, Single

    if make_engine is None:
        def make_engine():
            return ScriptedEngine(tok.encode(answer, add_special_tokens=False), tok.eos_ids[0])
    sched = Scheduler(tok)

    class Ok:
        def status(self):
            return True, ""

    state = AppState(sched, ctx, rs.TokenPieces(tok), Ok(), 1_000_000, int(time.time()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_config=None,
                                           lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()

    def loop():
        try:
            engine = make_engine()
            while not sched.stopping.is_set():
                step, result = advance(engine, Single(), Guard(), sched.plan(), keep_logprobs=True,
                                       agreed=sched.deliver)
                sched.absorb(step, result)
        except BaseException as e:  # the loop died: every open request fails at once (a test fails, not hangs)
            sched.fail_all(f"the test server's loop died: {type(e).__name__}: {e}", 500)
            raise

    threading.Thread(target=loop, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        sched.stop()
        server.should_exit = True


@pytest.fixture(scope="module")
def app_server():
    d = default_model_dir()
    tok = Tokenizer(d, read_config(d), chat_template=HERMES_TEMPLATE)
    answer = 'I will check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ctx = ParseContext(tokenizer=tok, vocab_size=read_config(d)["vocab_size"], model_ids=("m",), tool_format="hermes")
    with scripted_app(tok, ctx, answer) as base:
        yield base, tok, answer


def test_openai_client_gets_tool_calls_whole_and_streamed(app_server):
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    base, tok, answer = app_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the content first, then the call as OpenAI streams it (name, then arguments)
    content, names, args, finish = "", [], "", None
    for ch in client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=200,
                                             stream=True):
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.function.name:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert content == "I will check." and names == ["get_weather"] and json.loads(args) == {"city": "Paris"}
    assert finish == "tool_calls"
    # tool_choice none: the same words come back as text
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=200)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == tok.decode(tok.encode(answer, add_special_tokens=False))


def test_a_call_cut_by_max_tokens_is_not_a_call():
    # an answer cut inside a call must not give that call with half its arguments
    from mlxcel_dist.serve import tools

    whole = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
    cut = "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Pa"
    content, calls = tools.parse("glm45", whole + cut, [WEATHER])
    # ... nor content: its markup is dropped (OpenAI returns no call markup as content)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}] and content == ""
    mm = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n</invoke>\n'
          '<invoke name="get_weather">\n<parameter name="city">Pa')
    assert [json.loads(c["function"]["arguments"]) for c in tools.parse("minimax_m2", mm, [WEATHER])[1]] == [
        {"city": "Oslo"}]


@pytest.mark.parametrize("fmt,text", [
    ("hermes", 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("glm45", GLM), ("deepseek_v3", DS_V3.replace("<｜tool▁calls▁end｜>", "")),
    ("deepseek_v31", DS_V31.replace("<｜tool▁calls▁end｜>", "")), ("kimi_k2", KIMI.replace("<|tool_calls_section_end|>", "")),
])
def test_a_cut_last_call_is_dropped_in_every_block_format(fmt, text):
    """Parallel calls cut by max_tokens inside the last one (or inside its
    start marker): the calls before it, the content before them, and none of
    the cut call's markup; the same streamed, at every split."""
    want = tools.parse(fmt, text, TYPED)
    assert want[1]
    begin = tools.BLOCKS[fmt][0]
    for tail in (begin[:3], begin, begin + 'get_weather<｜tool▁sep｜>{"ci', "\n" + begin + '{"name": "get_w'):
        got = tools.parse(fmt, text + tail, TYPED)
        assert got[0] == want[0] and [c["function"] for c in got[1]] == [c["function"] for c in want[1]], tail
        for cut in range(0, len(text + tail), 7):
            sp = tools.StreamParser(fmt, TYPED)
            sent = sp.feed((text + tail)[:cut]) + sp.feed((text + tail)[cut:])
            rest, calls = sp.finish()
            assert (sent + rest).strip() == want[0] and [c["function"] for c in calls] == [c["function"] for c in want[1]]


def test_forced_answers_never_leave_call_markup_as_content():
    """Forced calls (the answer is calls only): an answer cut before any
    whole call is no content in any format; llama3_json's calls joined by
    ";" keep the whole ones before a cut last one."""
    cut = {"hermes": '<tool_call>\n{"name": "get_wea', "llama3_json": '{"name": "get_weather", "parameters": {"ci',
           "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Os', "glm45": "<tool_call>get_w",
           "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"ci",
           "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
           "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Os',
           "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"ci'}
    for fmt, text in cut.items():
        assert tools.parse(fmt, text, TYPED, forced=True) == ("", []), fmt
        assert tools.parse(fmt, text, TYPED)[1] == []  # auto: its words stay (they may be no call at all)
    two = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "param'
    for forced in (True, False):
        content, calls = tools.parse("llama3_json", two, TYPED, forced=forced)
        assert content == "" and [(c["function"]["name"], _args(c)) for c in calls] == [("get_weather",
                                                                                          {"city": "Oslo"})]
