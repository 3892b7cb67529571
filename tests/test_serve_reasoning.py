"""Reasoning text: the splitter (whole and streamed at every cut), the form
detected from the template, the template's thinking switches
(chat_template_kwargs, reasoning_effort), and the real `openai` client
against the HTTP app in process, whose engine is scripted to think then
answer (and, for gpt-oss's harmony, to call a tool)."""

from __future__ import annotations

import contextlib
import json

import pytest

from mlxcel_dist.checkpoint.loader import default_model_dir, read_config
from mlxcel_dist.serve import reasoning
from mlxcel_dist.serve.openai_api import parse
from mlxcel_dist.serve.openai_schema import ApiError, ParseContext
from mlxcel_dist.checkpoint.tokenizer import Tokenizer

from test_serve_tools import WEATHER, scripted_app

# A Qwen3-style template, reduced: the thinking switch closes an empty block.
QWEN3 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
         "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# DeepSeek-R1's: the generation prompt opens the block, the model writes only its end.
R1 = ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}{# </think> #}")
# gpt-oss's: harmony messages, reasoning_effort in the system message.
HARMONY = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
           "{% if tools %}<|start|>developer<|message|>namespace functions {}<|end|>{% endif %}"
           "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
           "{# <|channel|>analysis to=functions.x <|call|> #}")


@pytest.mark.parametrize("fmt,thinking,text,want", [
    ("qwen3", False, "<think>\nThe user greets.\n</think>\n\nHello!", ("The user greets.", "Hello!")),
    ("qwen3", False, "Hello, no thinking.", ("", "Hello, no thinking.")),
    ("qwen3", False, "  Text then <think>not thinking</think>", ("", "  Text then <think>not thinking</think>")),
    ("qwen3", False, "<think>cut off mid-thought", ("cut off mid-thought", "")),
    ("deepseek_r1", True, "It is 2 + 2.\n</think>\n\n4", ("It is 2 + 2.", "4")),
    ("gpt_oss", False, "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Hello!", ("User greets.", "Hello!")),
    ("gpt_oss", False, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
                       "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
     ("Need the weather.", '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}')),
    ("gpt_oss", False, "no harmony here", ("", "no harmony here")),
])
def test_split_whole_and_streamed_at_every_cut(fmt, thinking, text, want):
    assert reasoning.split(fmt, text, thinking) == want
    for parts in [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]:  # and char by char
        s = reasoning.Splitter(fmt, thinking)
        got = [s.feed(p) for p in parts] + [s.finish()]
        assert ("".join(a for a, _ in got), "".join(b for _, b in got)) == want, parts


def test_detect_and_where_the_answer_starts():
    assert reasoning.detect(QWEN3) == "qwen3" and reasoning.detect(R1) == "deepseek_r1"
    assert reasoning.detect(HARMONY) == "gpt_oss"
    assert reasoning.detect("{{ messages }}") is None and reasoning.detect(None) is None
    assert reasoning.starts_thinking("deepseek_r1", "<｜User｜>hi<｜Assistant｜><think>\n")
    assert not reasoning.starts_thinking("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.starts_thinking("qwen3", "<|im_start|>assistant\n")
    assert reasoning.template_vars(HARMONY) == {"reasoning_effort"}
    assert reasoning.template_vars(QWEN3) == {"enable_thinking"}


def _ctx(template, **kw):
    d = default_model_dir()
    tok = Tokenizer(d, read_config(d), chat_template=template)
    return tok, ParseContext(tokenizer=tok, vocab_size=read_config(d)["vocab_size"], model_ids=("m",),
                             reasoning_format=reasoning.detect(template), template_vars=reasoning.template_vars(
                                 template), **kw)


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def test_template_switches_reach_the_template():
    tok, ctx = _ctx(QWEN3)
    p = parse(CHAT, True, ctx)
    assert p.reasoning == "qwen3" and not p.thinking and not p.keep_special
    off = parse({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, True, ctx)
    assert tok.decode(off.req.prompt_ids).endswith("<think>\n\n</think>\n\n") and not off.thinking
    for bad in ({"messages": 1}, {"add_generation_prompt": False}, {"not a name": 1}):
        with pytest.raises(ApiError) as e:
            parse({**CHAT, "chat_template_kwargs": bad}, True, ctx)
        assert e.value.param == "chat_template_kwargs"
    with pytest.raises(ApiError) as e:  # this template has no reasoning_effort: not silently ignored
        parse({**CHAT, "reasoning_effort": "low"}, True, ctx)
    assert e.value.code == "unsupported_parameter" and e.value.param == "reasoning_effort"
    comp = parse({"prompt": "Hi", "max_tokens": 2}, False, ctx)
    assert comp.reasoning is None  # completions are raw text
    tok, ctx = _ctx(R1)
    assert parse(CHAT, True, ctx).thinking  # the template opened the block
    tok, ctx = _ctx(HARMONY, tool_format="harmony")
    low = parse({**CHAT, "reasoning_effort": "low", "tools": [WEATHER]}, True, ctx)
    assert "Reasoning: low" in tok.decode(low.req.prompt_ids)
    assert low.reasoning == "gpt_oss" and low.keep_special and low.tool_format == "harmony"
    with pytest.raises(ApiError):
        parse({**CHAT, "reasoning_effort": "extreme"}, True, ctx)


# --------------------------------------------------------------------------- the app, in process
@contextlib.contextmanager
def _app(template, answer, **ctx_kw):
    tok, ctx = _ctx(template, **ctx_kw)
    with scripted_app(tok, ctx, answer) as base:
        yield base, tok


def _streamed(chunks) -> dict:
    """index -> (reasoning, content, tool calls [(name, arguments)], finish) of a stream."""
    out = {}
    for ch in chunks:
        for c in ch.choices:
            r, t, calls, f = out.get(c.index, ("", "", [], None))
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")  # the two names, one text
            r += extra.get("reasoning_content") or ""
            t += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.function.name:
                    calls.append([tc.function.name, ""])
                calls[-1][1] += tc.function.arguments or ""
            out[c.index] = (r, t, calls, c.finish_reason or f)
    return out


def test_openai_client_gets_reasoning_content_whole_and_streamed():
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    answer = "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"
    with _app(QWEN3, answer) as (base, tok):
        thought, content = reasoning.split("qwen3", tok.decode(tok.encode(answer, add_special_tokens=False)))
        assert thought == "The user wants a greeting." and content == "Hello there!"
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=100, n=2)
        for c in r.choices:
            assert c.message.content == content and c.finish_reason == "stop"
            assert c.message.reasoning_content == thought and c.message.reasoning == thought
        got = _streamed(client.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=100,
                                                       n=2, stream=True))
        assert got == {0: (thought, content, [], "stop"), 1: (thought, content, [], "stop")}
        # completions stay raw text
        r = client.completions.create(model="m", prompt="Hi", max_tokens=100)
        assert r.choices[0].text == tok.decode(tok.encode(answer, add_special_tokens=False))


def test_openai_client_gets_harmony_reasoning_and_tool_call():
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    answer = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
              "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")
    with _app(HARMONY, answer, tool_format="harmony") as (base, tok):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="m", messages=CHAT["messages"], max_tokens=200, tools=[WEATHER])
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "Need the weather."
        assert c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        (got,) = _streamed(client.chat.completions.create(**kw, stream=True)).values()
        assert got[0] == "Need the weather." and got[1] == "" and got[3] == "tool_calls"
        assert [(n, json.loads(a)) for n, a in got[2]] == [("get_weather", {"city": "Paris"})]


def test_markers_that_are_special_tokens_are_kept():
    # A vocabulary where </think> (or a call's start) is a special token:
    # decoding would drop it, so such rows are detokenised keeping them.
    from mlxcel_dist.serve.lifecycle import _template_formats

    class Tok:
        def __init__(self, special):
            self.special = special

        def chat_template(self):
            return QWEN3 + "{# tools: <tool_call> #}", "here"

        def encode(self, text, add_special_tokens=True):
            return [text]

        def decode(self, ids):
            return "".join(t for t in ids if t not in self.special)

    assert _template_formats(Tok(set()), None, None) == {
        "tool_format": "hermes", "reasoning_format": "qwen3", "template_vars": {"enable_thinking"},
        "keep_special": False}
    assert _template_formats(Tok({"</think>"}), None, None)["keep_special"]
    assert _template_formats(Tok({"<tool_call>"}), None, "none") == {
        "tool_format": "hermes", "reasoning_format": None, "template_vars": {"enable_thinking"}, "keep_special": True}
    tok, ctx = _ctx(QWEN3, keep_special=True)
    assert parse(CHAT, True, ctx).keep_special and not parse({"prompt": "x"}, False, ctx).keep_special


def test_constrained_answers_come_after_the_thinking(tmp_path):
    """response_format and forced calls on a thinking template: the model
    thinks freely, then the grammar holds (vLLM's structured output after
    reasoning). The real batch engine over the default model, in a vocabulary
    whose markers are special tokens (as the real checkpoints'); logit_bias
    on the markers lets the random model open and end its thinking soon.
    Every answer's content validates, the thinking is reasoning_content."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")
    from test_grammar import CLOCK, PARAMS, SCHEMA, jsonschema  # skips without llguidance / jsonschema

    from mlxcel_dist.engine import grammar
    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.checkpoint.loader import load_model
    from mlxcel_dist.serve.lifecycle import _template_formats
    from specialvocab import special_vocab

    d = special_vocab(tmp_path, grammar.MARKERS)
    n_vocab = read_config(d)["vocab_size"]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    for template in (QWEN3, R1, HARMONY):
        tok = Tokenizer(d, read_config(d), chat_template=template)
        ctx = ParseContext(tokenizer=tok, vocab_size=n_vocab, model_ids=("m",),
                           **_template_formats(tok, None, None))
        # the markers, and the first token of "analysis" (harmony's thinking channel)
        ids = {m: tok.encode(m, add_special_tokens=False)[0] for m in ("<think>", "</think>", "<|end|>", "analysis")}
        vocab = grammar.Vocab(d / "tokenizer.json", n_vocab, tok.eos_ids)
        with scripted_app(tok, ctx, None, lambda: BatchEngine(load_model(default_model_dir()).model,
                                                              vocab=vocab)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            kw = dict(model="m", messages=CHAT["messages"], temperature=1.0, max_tokens=300, n=3,
                      logit_bias={str(i): 3 if m == "analysis" else 6 for m, i in ids.items()})
            thoughts, whole = [], {}
            for seed in (1, 2):
                for c in client.chat.completions.create(**kw, seed=seed, response_format=rf).choices:
                    assert c.finish_reason == "stop", (template[:20], c)
                    jsonschema.validate(json.loads(c.message.content), SCHEMA)
                    thoughts.append((c.message.model_extra or {}).get("reasoning_content") or "")
                    whole.setdefault(seed, {})[c.index] = (thoughts[-1], c.message.content, [], "stop")
            assert any(thoughts), template[:20]  # the model did think first
            # streamed: the same answers (the same seeds, the same batch), thinking and content apart
            streamed = client.chat.completions.create(**kw, seed=1, response_format=rf, stream=True)
            assert _streamed(streamed) == whole[1]
            if ctx.tool_format == "harmony":  # a forced call after the analysis message
                r = client.chat.completions.create(**kw, seed=3, tools=[CLOCK], tool_choice="required")
                for c in r.choices:
                    assert c.finish_reason == "tool_calls", c
                    (call,) = c.message.tool_calls
                    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_time"])
