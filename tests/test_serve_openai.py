"""mlxcel_dist.serve.openai_api in process: request parsing (every refusal an
OpenAI-shaped ApiError), the JSON reader's limits, and the response shapes."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from mlxcel_dist.checkpoint.loader import default_model_dir, read_config
from mlxcel_dist.serve import wire
from mlxcel_dist.serve.openai_api import context_limit, convert_chat, no_chat_template, parse
from mlxcel_dist.serve.openai_schema import (
    ApiError, ChatCompletionRequest, CompletionRequest, Defaults, ParseContext, loads_limited,
)
from mlxcel_dist.serve.responses import (
    FINISH, TokenPieces, stream_chunk, stream_error, usage, usage_chunk, whole_choice, whole_response,
)
from mlxcel_dist.checkpoint.tokenizer import Tokenizer

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
COMP = {"prompt": "The sea", "max_tokens": 4}


@pytest.fixture(scope="module")
def tok():
    d = default_model_dir()
    return Tokenizer(d, read_config(d))


@pytest.fixture(scope="module")
def ctx(tok):
    cfg = read_config(default_model_dir())
    return ParseContext(tok, cfg["vocab_size"], ("served", "alias"), context_length=context_limit(cfg))


def refused(body, chat, ctx, status=400) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, chat, ctx)
    assert e.value.status == status, e.value.body()
    return e.value


def raw_refused(raw: bytes, chat, ctx) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(loads_limited(raw), chat, ctx)
    assert e.value.status == 400
    return e.value


# The messages tests/test_serve.py matches against a live server.
@pytest.mark.parametrize("chat,raw,message", [
    (False, b"{not json", "malformed JSON"),
    (False, b"[1, 2]", "JSON object"),
    (False, b'{"max_tokens": 4}', "missing field 'prompt'"),
    (True, b'{"prompt": "x"}', "missing field 'messages'"),
    (False, b'{"prompt": "x", "temperature": -1}', "'temperature' must be >= 0"),
    (False, b'{"prompt": "x", "top_p": 0}', "'top_p' must be > 0"),
    (False, b'{"prompt": "x", "max_tokens": 100000}', "'max_tokens' must be <= 4096"),
    (False, b'{"prompt": "x", "max_tokens": "5"}', "'max_tokens' must be an integer"),
    (False, b'{"prompt": "x", "stop": [""]}', "'stop' must be"),
    (False, b'{"prompt": "x", "ignore_eos": "yes"}', "'ignore_eos' must be true or false"),
    (False, b'{"prompt": [99999999]}', "outside the vocabulary"),
    (True, b'{"messages": [{"content": "x"}]}', "'role'"),
    (False, b'{"prompt": "caf\xe9"}', "not valid UTF-8: byte 0xe9 at offset"),
    (False, b'{"prompt": "a\\ud800b"}', "'prompt' is not valid Unicode text"),
    (True, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content is not valid Unicode text"),
    (True, b'{"messages": [{"role": "system", "content": "x\\ud83d"}, {"role": "user", "content": "y"}]}',
     "messages[0].content is not valid Unicode text"),
    (False, b'{"prompt": "x", "stop": ["\\ud800"]}', "'stop' is not valid Unicode text"),
    (False, b'{"prompt": "x", "stop": "\\ud800"}', "'stop' is not valid Unicode text"),
    (True, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content is not valid Unicode text"),
])
def test_kept_messages(ctx, chat, raw, message):
    e = raw_refused(raw, chat, ctx)
    assert message in e.message and "\n" not in e.message, e.message


@pytest.mark.parametrize("field,value,message", [
    ("top_k", 2147483648, "'top_k' must be <= 2147483647, got 2147483648"),
    ("top_k", 1e30, "'top_k' must be an integer, got 1e+30"),
    ("top_k", 3.0, "'top_k' must be an integer, got 3.0"),
    ("top_k", True, "'top_k' must be an integer, got true"),
    ("max_tokens", 0, "'max_tokens' must be >= 1, got 0"),
    ("temperature", 5, "'temperature' must be <= 2, got 5"),
    ("temperature", "hot", "'temperature' must be a number, got \"hot\""),
    ("temperature", float("inf"), "'temperature' must be finite, got inf"),
    ("top_p", 1.5, "'top_p' must be <= 1, got 1.5"),
    ("min_p", -0.1, "'min_p' must be >= 0, got -0.1"),
    ("repetition_penalty", 0, "'repetition_penalty' must be > 0, got 0"),
    ("repetition_penalty", float("nan"), "'repetition_penalty' must be finite, got nan"),
    ("seed", -1, "'seed' must be >= 0, got -1"),
    ("seed", 2**64, "'seed' must be <= 18446744073709551615, got 18446744073709551616"),
    pytest.param("seed", 10**5000, "'seed' must be <= 18446744073709551615, got an integer of about 5000 digits",
                 id="seed-5000-digits"),
    ("stream", "yes", "'stream' must be true or false, got \"yes\""),
    ("model", 5, "'model' must be a string, got 5"),
    ("stop", ["a"] * 17, "'stop' must be a non-empty string or a list of at most 16 non-empty strings"),
    ("top_logprobs", 21, "'top_logprobs' must be <= 20, got 21"),
])
def test_field_bounds_name_the_field(ctx, field, value, message):
    for chat, base in ((False, COMP), (True, CHAT)):
        e = refused({**base, field: value}, chat, ctx)
        assert e.param == field and e.message.startswith(message), e.body()
        assert e.type == "invalid_request_error" and e.code is None


def test_max_completion_tokens_zero_and_over_cap(ctx):
    e = refused({**CHAT, "max_completion_tokens": 0}, True, ctx)
    assert (e.param, e.message) == ("max_completion_tokens", "'max_completion_tokens' must be >= 1, got 0")
    e = refused({**CHAT, "max_completion_tokens": 5000}, True, ctx)
    assert (e.param, e.message) == ("max_completion_tokens", "'max_completion_tokens' must be <= 4096, got 5000")
    assert parse({**CHAT, "max_tokens": 9, "max_completion_tokens": 3}, True, ctx).req.max_tokens == 3


def test_top_k_limits_through_json(ctx):
    for raw in (b'{"prompt": "x", "top_k": 2147483648}', b'{"prompt": "x", "top_k": 1e30}'):
        assert raw_refused(raw, False, ctx).param == "top_k"
    assert parse(loads_limited(b'{"prompt": "x", "top_k": 2147483647}'), False, ctx).req.sampling.top_k == 2**31 - 1


def test_roles(ctx):
    e = refused({"messages": [{"role": "wizard", "content": "x"}]}, True, ctx)
    assert e.param == "messages", e.body()
    assert e.message.startswith("messages[0].role must be one of system, developer"), e.message
    assert '"wizard"' in e.message
    e = refused({"messages": [{"role": "user", "content": "x"}, {"role": 3, "content": "x"}]}, True, ctx)
    assert e.message == "messages[1] must be an object with a string 'role'"
    assert refused({"messages": ["hi"]}, True, ctx).message == "messages[0] must be an object with a string 'role'"
    for role in ("system", "developer", "user", "assistant"):
        assert parse({"messages": [{"role": role, "content": "x"}, {"role": "user", "content": "y"}]}, True, ctx)


def test_message_content(ctx, tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content":
            [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    p = parse({"messages": msgs}, True, ctx)
    assert p.req.prompt_ids == tok.chat_ids([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                                             {"role": "user", "content": "ab"}])
    e = refused({"messages": [{"role": "user", "content": None}]}, True, ctx)
    assert e.message.startswith("messages[0].content must be a string or a list of text parts"), e.message
    e = refused({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, True, ctx)
    assert e.message == "messages[0].content: only text parts are supported"
    e = refused({"messages": [{"role": "user", "content": 5}]}, True, ctx)
    assert e.message == "messages[0].content must be a string or a list of text parts, got 5"
    assert refused({"messages": []}, True, ctx).message == "'messages' must be a non-empty list"


def test_model_ids(ctx):
    e = refused({**COMP, "model": "gpt-4"}, False, ctx, status=404)
    assert e.body() == {"error": {"message": "The model `gpt-4` does not exist.", "type": "invalid_request_error",
                                  "param": "model", "code": "model_not_found"}}
    assert parse({**COMP, "model": "alias"}, False, ctx).model == "alias"
    assert parse(COMP, False, ctx).model == "served"
    assert parse({**CHAT, "model": "served"}, True, ctx).model == "served"


def test_deep_json_is_a_quick_400():
    t0 = time.monotonic()
    for raw in (b"[" * 20000 + b"]" * 20000, b'{"a":' * 20000 + b"1" + b"}" * 20000, b"[" * 20000):
        with pytest.raises(ApiError) as e:
            loads_limited(raw)
        assert (e.value.status, e.value.message) == (400, "JSON nested deeper than 64 levels")
    assert time.monotonic() - t0 < 1.0
    # brackets inside strings are text, not nesting; 64 levels are fine
    assert loads_limited(json.dumps({"s": "[{" * 5000 + '\\"]'}).encode()) == {"s": "[{" * 5000 + '\\"]'}
    deep = loads_limited(b"[" * 64 + b"]" * 64)
    for _ in range(63):
        assert isinstance(deep, list) and len(deep) == 1
        deep = deep[0]
    assert deep == []
    with pytest.raises(ApiError):
        loads_limited(b"[" * 65 + b"]" * 65)


def test_json_numbers_and_constants(ctx):
    for raw in (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", b'{"prompt": "x", "temperature": 0.' + b"1" * 100
                + b"}"):
        with pytest.raises(ApiError) as e:
            loads_limited(raw)
        assert e.value.status == 400 and "over the limit of 64" in e.value.message, e.value.message
    for const in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(ApiError) as e:
            loads_limited(b'{"prompt": "x", "temperature": ' + const + b"}")
        assert e.value.status == 400 and const.decode() in e.value.message
    assert loads_limited(b'{"a": 1.5, "b": -3, "c": 1e400}') == {"a": 1.5, "b": -3, "c": float("inf")}
    assert raw_refused(b'{"prompt": "x", "temperature": 1e400}', False, ctx).param == "temperature"
    assert refused({**COMP, "temperature": 10**400}, False, ctx).param == "temperature"


def test_bad_utf8():
    with pytest.raises(ApiError) as e:
        loads_limited(b'{"prompt": "ok\xff"}')
    assert e.value.status == 400 and "byte 0xff at offset 14" in e.value.message, e.value.message


def test_context_errors_name_prompt_or_messages(ctx):
    e = refused({"prompt": [5] * 600}, False, ctx)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    assert "(600 in the prompt, 16 in the completion). Please reduce the length of the prompt or" in e.message
    e = refused({"messages": [{"role": "user", "content": "sea " * 600}], "max_tokens": 5}, True, ctx)
    assert (e.param, e.code) == ("messages", "context_length_exceeded")
    assert "in the messages, 5 in the completion). Please reduce the length of the messages" in e.message
    p = parse({"prompt": [5] * 500}, False, ctx)  # a default shrinks to what fits
    assert p.req.max_tokens == 12
    assert parse({"prompt": [5] * 500, "max_tokens": 12}, False, ctx).req.max_tokens == 12
    assert refused({"prompt": [5] * 500, "max_tokens": 13}, False, ctx).code == "context_length_exceeded"


def test_default_max_tokens(tok):
    big = ParseContext(tok, 512, ("m",), context_length=100_000)
    assert parse({"messages": CHAT["messages"]}, True, big).req.max_tokens == 512
    assert parse({"prompt": "x"}, False, big).req.max_tokens == 16
    flags = ParseContext(tok, 512, ("m",), max_tokens_cap=10, defaults=Defaults(temp=0.0, top_k=5, max_tokens=7))
    req = parse({"prompt": "x"}, False, flags).req
    assert (req.max_tokens, req.sampling.temp, req.sampling.top_k) == (7, 0.0, 5)
    assert parse({"prompt": "x", "temperature": 0.5, "top_k": 0}, False, flags).req.sampling.temp == 0.5


def test_valid_request_round_trips_the_wire(ctx, tok):
    body = {"prompt": "The sea", "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "repetition_penalty": 1.1, "seed": 2**64 - 1, "stop": ["\n\n", "é"], "logprobs": 3, "ignore_eos": True,
            "user": "someone", "n": 1}
    req = parse(loads_limited(json.dumps(body).encode()), False, ctx).req
    assert req.prompt_ids == tok.encode("The sea") and req.stop == ["\n\n", "é"]
    assert (req.max_tokens, req.logprobs, req.ignore_eos, req.sampling.seed) == (9, 3, True, 2**64 - 1)
    assert (req.sampling.temp, req.sampling.top_p, req.sampling.min_p) == (0.7, 0.9, 0.05)
    chat = parse({**CHAT, "logprobs": True, "top_logprobs": 2, "stop": "x", "seed": 0}, True, ctx).req
    step = wire.Step(admissions=[(3, req), (4, chat)], removals=[1])
    back = wire.decode_step(wire.encode_step(step))
    assert back.admissions == [(3, req), (4, chat)] and back.removals == [1]
    assert chat.logprobs == 2 and chat.stop == ["x"]


def test_random_seed_when_absent(ctx):
    seeds = {parse(COMP, False, ctx).req.sampling.seed for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**64 for s in seeds)


def test_stream_options(ctx):
    p = parse({**COMP, "stream": True, "stream_options": {"include_usage": True}}, False, ctx)
    assert (p.stream, p.include_usage, p.chat) == (True, True, False)
    assert parse({**COMP, "stream": True}, False, ctx).include_usage is False
    e = refused({**COMP, "stream_options": {"include_usage": True}}, False, ctx)
    assert e.param == "stream_options" and "only allowed when 'stream' is enabled" in e.message
    e = refused({**COMP, "stream": True, "stream_options": {"include_usage": "yes"}}, False, ctx)
    assert e.param == "stream_options" and e.message.startswith("'stream_options.include_usage' must be true")
    assert refused({**COMP, "stream": True, "stream_options": 3}, False, ctx).message.startswith(
        "'stream_options' must be an object")


def test_logprobs_settings(ctx, tok):
    assert parse({**COMP, "logprobs": 3}, False, ctx).req.logprobs == 3
    assert parse({**COMP, "logprobs": True}, False, ctx).req.logprobs == 0
    assert parse({**CHAT, "logprobs": True, "top_logprobs": -1}, True, ctx).req.logprobs == 0
    assert parse({**CHAT, "logprobs": False, "top_logprobs": 0}, True, ctx).req.logprobs is None
    for chat, body, param in [(True, {**CHAT, "logprobs": 3}, "logprobs"),
                              (True, {**CHAT, "top_logprobs": 2}, "top_logprobs"),
                              (False, {**COMP, "logprobs": -1}, "logprobs"),
                              (False, {**COMP, "logprobs": 21}, "logprobs"),
                              (False, {**COMP, "logprobs": 2, "top_logprobs": 2}, "top_logprobs")]:
        assert refused(body, chat, ctx).param == param, body
    assert "(the number of alternatives is 'top_logprobs')" in refused({**CHAT, "logprobs": 3}, True, ctx).message
    no_lp = ParseContext(tok, 512, ("m",), logprobs_ok=False)
    e = refused({**COMP, "logprobs": 1}, False, no_lp)
    assert (e.param, e.code) == ("logprobs", "unsupported_parameter")
    assert parse(COMP, False, no_lp).req.logprobs is None


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_unsupported_fields(ctx):
    for name, value in [("echo", True), ("tools", [WEATHER_TOOL])]:
        e = refused({**CHAT, name: value}, True, ctx)
        assert (e.param, e.code) == (name, "unsupported_parameter") and f"'{name}' is not supported" in e.message
    neutral = {"n": 1, "echo": False, "tools": [], "tool_choice": "none", "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0.0, "response_format": {"type": "text"}, "user": "u", "metadata": {"a": "b"}}
    assert parse({**CHAT, **neutral}, True, ctx).req.max_tokens == 4


def test_n_choices(ctx):
    assert parse({**CHAT, "n": 16}, True, ctx).n == 16 and parse(CHAT, True, ctx).n == 1
    for value in (0, 17, 10**5000, "2", 2.0):
        e = refused({**CHAT, "n": value}, True, ctx)
        assert e.param == "n" and "'n' must be" in e.message
    small = ParseContext(tokenizer=ctx.tokenizer, vocab_size=ctx.vocab_size, model_ids=ctx.model_ids, max_n=4)
    e = refused({**COMP, "n": 5}, False, small)
    assert e.param == "n" and "<= 4" in e.message and "--decode-concurrency" in e.message


def test_penalties_logit_bias_and_stop_token_ids(ctx, tok):
    body = {**COMP, "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": 100, "3": -2.5},
            "stop_token_ids": [5, 9]}
    req = parse(body, False, ctx).req
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.5, -1.0, ((3, -2.5), (7, 100.0)))
    assert req.stop_ids == [5, 9]
    back = wire.decode_request(*wire.encode_request(req))  # what every rank gets
    assert back.sampling == s and back.stop_ids == [5, 9]
    for field, value, says in [
        ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
        ("logit_bias", {"x": 1}, "token ids in [0, "), ("logit_bias", {str(ctx.vocab_size): 1}, "token ids in [0, "),
        ("logit_bias", {"1": 101}, "[-100, 100]"), ("logit_bias", {"1": "a"}, "logit_bias"),
        ("stop_token_ids", [ctx.vocab_size], "stop_token_ids"), ("stop_token_ids", [-1], "stop_token_ids"),
        ("logit_bias", {str(i): 1 for i in range(1025)}, "logit_bias"),
    ]:
        e = refused({**COMP, field: value}, False, ctx)
        assert e.param == field and says in e.message, (field, value, e.message)


def test_ignore_eos_and_stop(ctx):
    assert parse({**COMP, "ignore_eos": True}, False, ctx).req.ignore_eos is True
    assert parse({**COMP, "ignore_eos": None}, False, ctx).req.ignore_eos is False
    assert parse({**COMP, "stop": None}, False, ctx).req.stop == []


def test_prompt_shapes(ctx, tok):
    assert parse({"prompt": ["The sea"]}, False, ctx).req.prompt_ids == tok.encode("The sea")
    assert parse({"prompt": [2, 5, 7]}, False, ctx).req.prompt_ids == [2, 5, 7]
    several = parse({"prompt": ["The sea", "a"], "n": 2}, False, ctx)  # several prompts: n choices each
    assert several.prompts == [tok.encode("The sea"), tok.encode("a")] and several.choices == 4
    assert several.prompt_tokens == len(tok.encode("The sea")) + len(tok.encode("a"))
    assert parse({"prompt": [[2, 5], [7]]}, False, ctx).prompts == [[2, 5], [7]]
    for p in ([], [1, True], 5, [10**30], [[1], []], [[1], "a"], [[1], 2]):
        e = refused({"prompt": p}, False, ctx)
        assert e.param == "prompt" and ("'prompt' must be" in e.message or "outside the vocabulary" in e.message)


def test_plain_chat_renders_convert_chat(tok):
    plain = ParseContext(tok, 512, ("m",), plain_chat=True)
    assert no_chat_template(tok) is False
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert parse({"messages": msgs}, True, plain).req.prompt_ids == tok.encode(convert_chat(msgs))
    rm = {"user": "U: ", "assistant": "A: ", "stop": "\n"}
    got = parse({"messages": msgs[1:], "role_mapping": rm}, True, plain).req.prompt_ids
    assert got == tok.encode("U: Hi\nA:")
    assert refused({"messages": msgs, "role_mapping": {"user": 1}}, True, plain).param == "role_mapping"


def test_wire_check_is_defence_in_depth(ctx):
    huge = ParseContext(ctx.tokenizer, 512, ("m",), max_tokens_cap=2**40)
    e = refused({**COMP, "max_tokens": 2**31}, False, huge)
    assert e.param == "max_tokens" and "[0, 2147483647]" in e.message


def test_api_error_body():
    e = ApiError("boom", 503, code=503)
    assert e.body() == {"error": {"message": "boom", "type": "server_error", "param": None, "code": "503"}}
    assert ApiError("x").body()["error"] == {"message": "x", "type": "invalid_request_error", "param": None,
                                             "code": None}
    assert str(ApiError("y", 404)) == "y"


def test_stream_error():
    assert stream_error("the server is shutting down", 503) == {"error": {
        "message": "the server is shutting down", "type": "server_error", "param": None,
        "code": "service_unavailable"}}
    assert stream_error("bug", 500)["error"]["code"] == "internal_error"
    e = stream_error("bad", 400)["error"]
    assert e["type"] == "invalid_request_error" and isinstance(e["code"], str)
    assert isinstance(stream_error("?", 599)["error"]["code"], str)


def test_whole_response_shapes(ctx, tok):
    pieces = TokenPieces(tok)
    ids = tok.encode("The sea is", add_special_tokens=False)
    entries = [(i, (-0.5, [(i, -0.5), (0, float("-inf"))])) for i in ids]
    text = "".join(pieces(i)[0] for i in ids)
    p = parse({**COMP, "logprobs": 1}, False, ctx)
    r = whole_response(p, "cmpl-1", 7, [whole_choice(p, 0, text, "eos", entries, pieces)], 3, len(ids))
    assert (r["object"], r["id"], r["created"], r["model"]) == ("text_completion", "cmpl-1", 7, "served")
    c = r["choices"][0]
    assert (c["text"], c["finish_reason"], c["index"]) == (text, "stop", 0)
    assert c["logprobs"]["tokens"] == [pieces(i)[0] for i in ids] and c["logprobs"]["token_logprobs"][0] == -0.5
    assert c["logprobs"]["text_offset"][-1] == len(text) - len(pieces(ids[-1])[0])
    assert list(c["logprobs"]["top_logprobs"][0].values()) == [-0.5, -9999.0]
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)}
    pc = parse({**CHAT, "model": "alias"}, True, ctx)
    r = whole_response(pc, "chatcmpl-1", 7, [whole_choice(pc, 0, "hi", "length", [], pieces)], 3, 2)
    assert r["object"] == "chat.completion" and r["model"] == "alias"
    assert r["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                               "finish_reason": "length"}
    lp = whole_choice(parse({**CHAT, "logprobs": True, "top_logprobs": 1}, True, ctx), 0, text, "stop", entries,
                      pieces)["logprobs"]["content"]
    assert [e["token"] for e in lp] == [pieces(i)[0] for i in ids] and lp[0]["bytes"] == pieces(ids[0])[1]
    assert lp[0]["top_logprobs"][1]["logprob"] == -9999.0
    assert FINISH == {"eos": "stop", "stop": "stop", "length": "length"}


def test_stream_chunks_and_usage(ctx):
    p = parse({**CHAT, "stream": True, "stream_options": {"include_usage": True}}, True, ctx)
    first = stream_chunk(p, "c", 5, {"role": "assistant", "content": ""})
    assert first == {"id": "c", "object": "chat.completion.chunk", "created": 5, "model": "served", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        "usage": None}
    assert stream_chunk(p, "c", 5, {}, "eos")["choices"][0]["finish_reason"] == "stop"
    last = usage_chunk(p, "c", 5, 4, 2)
    assert last == {"id": "c", "object": "chat.completion.chunk", "created": 5, "model": "served", "choices": [],
                    "usage": usage(4, 2)} and last["usage"]["total_tokens"] == 6
    q = parse({**COMP, "stream": True}, False, ctx)
    ch = stream_chunk(q, "x", 5, "text", "length", {"tokens": ["a"]})
    assert "usage" not in ch and ch["object"] == "text_completion"
    assert ch["choices"][0] == {"index": 0, "text": "text", "logprobs": {"tokens": ["a"]}, "finish_reason": "length"}
    assert json.loads(json.dumps(last)) == last


def test_schemas_are_openapi_ready():
    chat, comp = ChatCompletionRequest.model_json_schema(), CompletionRequest.model_json_schema()
    assert "messages" in chat["required"] and "prompt" in comp["required"]
    assert chat["properties"]["temperature"]["anyOf"][0] == {"maximum": 2, "minimum": 0, "type": "number"}
    assert chat["$defs"]["ChatMessage"]["properties"]["role"]["enum"] == [
        "system", "developer", "user", "assistant", "tool"]
    assert chat["additionalProperties"] is True
    assert np.isfinite(comp["properties"]["top_k"]["anyOf"][0]["maximum"])
