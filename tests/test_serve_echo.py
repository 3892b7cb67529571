"""Completions' `echo` (what lm-eval's loglikelihood tasks send: `echo: true,
logprobs: 1, max_tokens: 0`): the prompt's text and each prompt token's
logprob (the first null) are the model's own log-softmax at the position
before it, computed in the prompt's prefill chunks on every rank; with
max_tokens 0 no row decodes. Through the real openai client, whole and
streamed, with several prompts in one request."""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai package is not installed (optional)")

import mlx.core as mx  # noqa: E402

from mlxcel_dist.engine.batch import BatchEngine  # noqa: E402
from mlxcel_dist.engine.generation import sequence_logits  # noqa: E402
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model, read_config  # noqa: E402
from mlxcel_dist.engine.prefill import Budget, Request  # noqa: E402
from mlxcel_dist.serve.lifecycle import _template_formats  # noqa: E402
from mlxcel_dist.serve.openai_api import context_limit  # noqa: E402
from mlxcel_dist.serve.openai_schema import ParseContext  # noqa: E402
from mlxcel_dist.checkpoint.tokenizer import Tokenizer  # noqa: E402
from test_serve_tools import scripted_app  # noqa: E402

TEXTS = ["The sea is calm today.", "Numbers: 1, 2, 3"]


def _reference(model, ids):
    """Each token's log-softmax logprob at the position before it (one pass), and the top id."""
    x = mx.array(sequence_logits(model, np.asarray(ids))).astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    lp = np.array(lp)
    return [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))], [int(np.argmax(lp[j - 1])) for j in range(1, len(ids))]


def test_engine_gives_the_prompts_logprobs_in_chunks_and_no_row_for_max_tokens_0():
    model = load_model(default_model_dir()).model
    tok = Tokenizer(default_model_dir(), read_config(default_model_dir()))
    ids = tok.encode("The sea is calm today. The sky is clear and the sun is warm.")
    want, top = _reference(model, ids)
    eng = BatchEngine(model, prefill_step=4, budget=Budget(4))  # chunks of 4: the logprobs cross them
    eng.add_many([Request(0, [5, 6, 7], budget=30)])
    eng.step()
    eng.add_many([Request(1, ids, budget=0, echo=2), Request(2, ids, budget=3, echo=0)])
    while eng.prefilling:
        out = eng.step()
        assert 0 in out  # the decoding row keeps its step
    assert 1 not in eng and 2 in eng  # max_tokens 0: the prompt's logprobs only
    got = eng.prompt_logprobs
    assert got[1][0] is None and len(got[1]) == len(ids)
    np.testing.assert_allclose([lp for lp, _ in got[1][1:]], want, atol=1e-4)
    assert [t[0][0] for _, t in got[1][1:]] == top and all(len(t) == 2 for _, t in got[1][1:])
    np.testing.assert_allclose([lp for lp, _ in got[2][1:]], want, atol=1e-4)


@pytest.fixture(scope="module")
def app():
    d = default_model_dir()
    cfg = read_config(d)
    tok = Tokenizer(d, cfg)
    ctx = ParseContext(tokenizer=tok, vocab_size=cfg["vocab_size"], model_ids=("m",),
                       context_length=context_limit(cfg), **_template_formats(tok, None, None))
    with scripted_app(tok, ctx, None, lambda: BatchEngine(load_model(d).model)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300), tok


def test_echo_as_lm_eval_sends_it(app):
    client, tok = app
    model = load_model(default_model_dir()).model
    r = client.completions.create(model="m", prompt=TEXTS, echo=True, logprobs=1, max_tokens=0, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for text, c in zip(TEXTS, r.choices):
        ids = tok.encode(text)
        want, _ = _reference(model, ids)
        assert c.text == text and c.finish_reason == "length"
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        np.testing.assert_allclose(c.logprobs.token_logprobs[1:], want, atol=1e-4)
        assert len(c.logprobs.tokens) == len(ids) and all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)


def test_echo_then_an_answer_whole_and_streamed(app):
    client, tok = app
    plain = client.completions.create(model="m", prompt=TEXTS[0], max_tokens=6, temperature=0, logprobs=0)
    whole = client.completions.create(model="m", prompt=TEXTS[0], max_tokens=6, temperature=0, logprobs=0, echo=True)
    c = whole.choices[0]
    assert c.text == TEXTS[0] + plain.choices[0].text
    n = len(tok.encode(TEXTS[0]))
    assert c.logprobs.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    assert c.logprobs.text_offset[n] == len("".join(c.logprobs.tokens[:n]))
    stream = client.completions.create(model="m", prompt=TEXTS[0], max_tokens=6, temperature=0, logprobs=0,
                                       echo=True, stream=True)
    text, lps = "", []
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].text
            lps += ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else []
    assert text == c.text and lps == c.logprobs.token_logprobs
    no_lp = client.completions.create(model="m", prompt=TEXTS[0], max_tokens=6, temperature=0, echo=True)
    assert no_lp.choices[0].text == c.text and no_lp.choices[0].logprobs is None


def test_echo_refusals(app):
    client, _ = app
    with pytest.raises(openai.BadRequestError, match="must be >= 1, got 0"):
        client.completions.create(model="m", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="a completions field"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"echo": True})
