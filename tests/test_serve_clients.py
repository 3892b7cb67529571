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

from mlxcel_dist import grammar  # noqa: E402
from mlxcel_dist.loader import default_model_dir, read_config  # noqa: E402
from mlxcel_dist.serve.lifecycle import _template_formats  # noqa: E402
from mlxcel_dist.serve.openai_api import ParseContext, context_limit  # noqa: E402
from mlxcel_dist.tokenizer import Tokenizer  # noqa: E402
from test_serve_tools import scripted_app  # noqa: E402

MSGS = [{"role": "user", "content": "The weather in Oslo"}]


def _app(vocab_limits=None):
    """(tokenizer, context, a scripted_app over the default model's BatchEngine);
    the engine and the scheduler share one grammar.Vocab, as in serve."""
    from mlxcel_dist.batch import BatchEngine
    from mlxcel_dist.loader import load_model

    d = default_model_dir()
    cfg = read_config(d)
    tok = Tokenizer(d, cfg)
    ctx = ParseContext(tokenizer=tok, vocab_size=cfg["vocab_size"], model_ids=("m",),
                       context_length=context_limit(cfg), **_template_formats(tok, None, None))
    vocab = grammar.Vocab(d / "tokenizer.json", cfg["vocab_size"], tok.eos_ids)
    return tok, ctx, scripted_app(tok, ctx, None, lambda: BatchEngine(load_model(d).model, vocab=vocab), vocab)


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
    then, and the scheduler's own match of the ids ends the request with an
    error naming the grammar, whole (400) and streamed (an error event),
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
        # the server goes on: a plain request after it is answered
        r = client.chat.completions.create(model="m", messages=MSGS, max_tokens=4)
        assert r.choices[0].finish_reason == "length"
