"""Generation: sampler semantics (numpy and transformers references), seeded
reproducibility, streaming detokenisation (UTF-8, stop strings), chat
templates (vs transformers' apply_chat_template), the rank-agreement guard,
and the `generate` command, single-process and over 2 MPI ranks."""

import json
import os
import shutil
import subprocess
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlxcel_dist.cli import app
from mlxcel_dist.parallel.collectives import SINGLE
from mlxcel_dist.engine.guard import RankAgreement
from mlxcel_dist.engine.generation import Generation, generate_text
from mlxcel_dist.models.base import Capabilities
from mlxcel_dist.errors import UserError
from mlxcel_dist.checkpoint.loader import default_model_dir
from mlxcel_dist.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    process_logits,
)
from mlxcel_dist.checkpoint.tokenizer import RowText, StopStrings, StreamDecoder, Tokenizer, render_chat_template
from testproc import run_cmd

runner = CliRunner()
TINY = default_model_dir()
# The embedded model's greedy continuation of "The sea" (its README sample).
GREEDY_SEA = ("The sea is calm today. The sky is clear and the sun is warm. There is a light wind from the west. "
              "It is a good day to go out in a boat.")


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TINY)


# Sampler: numpy references ------------------------------------------------------
def np_softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def np_rep_penalty(x, ctx, p):
    x = x.copy()
    u = np.unique(ctx)
    x[u] = np.where(x[u] < 0, x[u] * p, x[u] / p)
    return x


def np_top_k(x, k):
    kth = np.sort(x)[::-1][k - 1]
    return np.where(x < kth, -np.inf, x)


def np_top_p(x, top_p):
    order = np.argsort(x, kind="stable")
    cum = np.cumsum(np_softmax(x[order]))
    remove = cum <= 1 - top_p
    remove[-1] = False
    out = x.copy()
    out[order[remove]] = -np.inf
    return out


def np_min_p(x, min_p):
    p = np_softmax(x)
    return np.where(p < min_p * p.max(), -np.inf, x)


def logits_fixture(seed=0, V=257, scale=3.0):
    return (np.random.default_rng(seed).normal(size=V) * scale).astype(np.float32)


def kept(x):
    return set(np.flatnonzero(np.isfinite(np.asarray(x))).tolist())


def test_filters_on_hand_made_logits():
    x = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))
    assert kept(apply_top_k(mx.array(x), 2)) == {0, 1}
    # ascending cumulative 0.1, 0.25, 0.5, 1: drop <= 0.3 -> tokens 3 and 2
    assert kept(apply_top_p(mx.array(x), 0.7)) == {0, 1}
    assert kept(apply_top_p(mx.array(x), 0.76)) == {0, 1, 2}
    assert kept(apply_top_p(mx.array(x), 1e-6)) == {0}  # the top token always stays
    # min-p 0.3: threshold 0.15 (0.15 itself stays: strictly below is dropped)
    assert kept(apply_min_p(mx.array(np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))), 0.25)) == {0, 1, 2}
    assert kept(apply_min_p(mx.array(x), 0.31)) == {0, 1}
    # repetition penalty: positive logits divided, negative multiplied, once per distinct id
    y = np.array([2.0, -2.0, 1.0, -1.0], np.float32)
    out = np.array(apply_repetition_penalty(mx.array(y), [0, 1, 1, 1], 2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0]
    out = np.array(apply_repetition_penalty(mx.array(y), [0, 1, 2, 3], 2.0, context_size=2))
    assert out.tolist() == [2.0, -2.0, 0.5, -2.0]


@pytest.mark.parametrize("seed", range(4))
def test_filters_match_numpy(seed):
    x = logits_fixture(seed)
    ctx = np.random.default_rng(100 + seed).integers(0, len(x), 40)
    np.testing.assert_array_equal(np.array(apply_top_k(mx.array(x), 17)), np_top_k(x, 17))
    for top_p in (0.3, 0.9):
        assert kept(apply_top_p(mx.array(x), top_p)) == kept(np_top_p(x, top_p))
    for min_p in (0.05, 0.5):
        assert kept(apply_min_p(mx.array(x), min_p)) == kept(np_min_p(x, min_p))
    np.testing.assert_array_equal(np.array(apply_repetition_penalty(mx.array(x), ctx, 1.3)),
                                  np_rep_penalty(x, ctx, np.float32(1.3)))


CHAINS = [
    SamplingParams(temp=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
    SamplingParams(temp=1.5, top_p=0.5),
    SamplingParams(temp=0.5, min_p=0.2),
    SamplingParams(temp=1.0, top_k=5, repetition_penalty=0.8),
    SamplingParams(temp=2.0, top_k=100, top_p=0.95, repetition_penalty=1.1, repetition_context_size=8),
]


@pytest.mark.parametrize("params", CHAINS, ids=lambda p: p.describe())
def test_chain_matches_numpy_in_documented_order(params):
    x = logits_fixture(7)
    ctx = np.random.default_rng(5).integers(0, len(x), 30)
    ref = np_rep_penalty(x, ctx[-params.repetition_context_size:] if params.repetition_context_size else ctx,
                         np.float32(params.repetition_penalty))
    ref = ref / np.float32(params.temp)
    if params.top_k:
        ref = np_top_k(ref, params.top_k)
    if params.top_p < 1:
        ref = np_top_p(ref, params.top_p)
    if params.min_p:
        ref = np_min_p(ref, params.min_p)
    ours = np.array(process_logits(mx.array(x), ctx.tolist(), params))
    assert kept(ours) == kept(ref)
    m = np.isfinite(ref)
    np.testing.assert_allclose(ours[m], ref[m], rtol=1e-6)


@pytest.mark.parametrize("params", CHAINS, ids=lambda p: p.describe())
def test_chain_matches_transformers_logits_processors(params):
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    x = logits_fixture(11)
    ctx = np.random.default_rng(3).integers(0, len(x), 30)
    procs = lp.LogitsProcessorList()
    # transformers' generate order: processors (repetition penalty), then the
    # sampling warpers temperature -> top-k -> top-p -> min-p.
    procs.append(lp.RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    procs.append(lp.TemperatureLogitsWarper(float(params.temp)))
    if params.top_k:
        procs.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        procs.append(lp.TopPLogitsWarper(params.top_p))
    procs.append(lp.MinPLogitsWarper(params.min_p))
    ids = ctx[-params.repetition_context_size:] if params.repetition_context_size else ctx
    ref = procs(torch.tensor(ids)[None], torch.tensor(x)[None].clone())[0].numpy()
    ours = np.array(process_logits(mx.array(x), ctx.tolist(), params))
    assert kept(ours) == kept(ref)
    m = np.isfinite(ref)
    np.testing.assert_array_equal(ours[m], ref[m])  # same float32 operations: bit-identical


# transformers' generate, recorded (scripts/make_transformers_fixtures.py): the
# comparison above without torch, on transformers' own processor list and order
HF_FIXTURES = Path(__file__).parent / "fixtures" / "transformers"
HF_SAMPLING = json.loads((HF_FIXTURES / "sampling.json").read_text())["cases"]


@pytest.fixture(scope="module")
def hf_sampling():
    with np.load(HF_FIXTURES / "sampling.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("case", HF_SAMPLING, ids=lambda c: c["name"])
def test_sampling_matches_recorded_transformers_generate(hf_sampling, case):
    i, params = case["index"], SamplingParams(**case["params"])
    x = mx.array(hf_sampling[f"logits_{i}"])
    scores = hf_sampling[f"scores_{i}"]
    context = hf_sampling[f"context_{i}"].tolist()
    sampler = Sampler(params)
    for step, want in enumerate(scores):
        # the same float32 operations: bit-identical, -inf where transformers removed a token
        np.testing.assert_array_equal(np.array(process_logits(x, context, params)), want)
        # the decode loop's form: the last id not yet read back from the device
        pending = process_logits(x, context[:-1], params, pending=mx.array(context[-1], dtype=mx.int32))
        np.testing.assert_array_equal(np.array(pending), want)
        if params.greedy:
            token = int(hf_sampling[f"tokens_{i}"][step])
            assert sampler(x, context) == token  # the token transformers chose
            context.append(token)
        else:
            drawn = {sampler(x, context) for _ in range(50)}
            assert drawn <= kept(want), "drew a token transformers removed"
            assert len(drawn) > 1 or len(kept(want)) == 1, "always the same token from several"
    assert len(scores) == case["steps"]


def test_greedy_is_argmax_after_repetition_penalty():
    x = np.array([1.0, 3.0, 2.9, -1.0], np.float32)
    assert Sampler(SamplingParams())(mx.array(x), []) == 1
    # 3.0 / 1.2 = 2.5 < 2.9: the penalty moves the argmax, as in transformers' greedy search
    assert Sampler(SamplingParams(repetition_penalty=1.2))(mx.array(x), [1]) == 2
    # temp 0 ignores the warpers (they never drop the argmax anyway)
    assert Sampler(SamplingParams(top_k=1, top_p=0.1, min_p=1.0))(mx.array(x), []) == 1


def draws(params, logits, n, ctx=()):
    s = Sampler(params)
    return [s(mx.array(logits), list(ctx)) for _ in range(n)]


def test_seeded_sampling_is_reproducible():
    x = logits_fixture(2, scale=1.0)
    p = SamplingParams(temp=1.0, seed=1234)
    a, b = draws(p, x, 64), draws(p, x, 64)
    assert a == b
    assert draws(SamplingParams(temp=1.0, seed=1235), x, 64) != a
    # the global MLX random state plays no part
    mx.random.seed(99)
    assert draws(p, x, 64) == a


def test_sampling_follows_the_filtered_distribution():
    x = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    got = np.bincount(draws(SamplingParams(temp=1.0, seed=0), x, 3000), minlength=3) / 3000
    np.testing.assert_allclose(got, [0.5, 0.3, 0.2], atol=0.035)
    # top-p 0.75 drops token 2; what is left is renormalised: 0.625 / 0.375
    got = np.bincount(draws(SamplingParams(temp=1.0, top_p=0.75, seed=1), x, 3000), minlength=3) / 3000
    assert got[2] == 0
    np.testing.assert_allclose(got[:2], [0.625, 0.375], atol=0.035)
    # top-k 3 of a bigger vocabulary: only the 3 largest ever come out
    y = logits_fixture(4, scale=0.5)
    assert set(draws(SamplingParams(temp=5.0, top_k=3, seed=2), y, 300)) == set(np.argsort(y)[-3:].tolist())


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"temp": -0.1}, "--temp must be >= 0"),
        ({"temp": float("nan")}, "--temp must be >= 0"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1]"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1]"),
        ({"top_k": -1}, "--top-k must be an integer >= 0"),
        ({"min_p": -0.1}, "--min-p must be in [0, 1]"),
        ({"min_p": 1.1}, "--min-p must be in [0, 1]"),
        ({"repetition_penalty": 0.0}, "--repetition-penalty must be > 0"),
        ({"repetition_context_size": -1}, "--repetition-context-size must be >= 0"),
        ({"seed": -1}, "--seed must be in [0, 2^64)"),
    ],
)
def test_bad_sampling_params(kw, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("^", r"\^")):
        SamplingParams(**kw).validate()


# Streaming detokenisation --------------------------------------------------------
def test_stream_decoder_never_emits_broken_utf8(tok):
    text = "naïve café — 🌊 ok, 日本語 and ü."
    ids = tok.encode(text, add_special_tokens=False)
    # the test means something: some tokens are only part of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    dec = StreamDecoder(tok)
    chunks = [dec.add(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text == tok.decode(ids)


def test_stream_decoder_is_incremental(tok, monkeypatch):
    ids = tok.encode(("The sea is calm. Café 🌊 naïve. " * 80), add_special_tokens=False)
    assert len(ids) > 1000
    decoded = []
    real = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, xs: decoded.append(len(list(xs))) or real(self, xs))
    dec = StreamDecoder(tok, context=ids[:4])
    out = "".join(dec.add(i) for i in ids[4:]) + dec.flush()
    assert out == real(tok, ids)[len(real(tok, ids[:4])):]
    # each token is decoded a bounded number of times: O(n), not O(n^2)
    assert sum(decoded) < 8 * len(ids), (sum(decoded), len(ids))


def test_stream_decoder_uses_prompt_context(tok):
    ids = tok.encode("The sea is calm today.")
    dec = StreamDecoder(tok, context=ids[:3])
    out = "".join(dec.add(i) for i in ids[3:]) + dec.flush()
    assert tok.decode(ids[:3]) + out == tok.decode(ids)


def test_stop_strings_hold_back_possible_prefixes():
    s = StopStrings(["sky is"])
    assert s.feed("The s") == "The "  # "s" could start "sky is"
    assert s.feed("k") == ""
    assert s.feed("y was") == "sky wa"  # "sky" decided: no stop; the last "s" is held back
    assert s.feed(" blue; the sky") == "s blue; the "
    assert s.feed(" is clear") == "" and s.stopped == "sky is"
    assert s.feed("more") == "" and s.flush() == ""


def test_stop_strings_earliest_match_wins_and_tail_is_flushed():
    s = StopStrings(["world", "lo w"])
    assert s.feed("hello world") == "hel" and s.stopped == "lo w"
    s = StopStrings(["\n\n"])
    assert s.feed("end\n") == "end" and s.flush() == "\n"
    with pytest.raises(UserError, match="--stop must not be empty"):
        StopStrings([""])


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_split_anywhere_is_never_printed(seed):
    rng = np.random.default_rng(seed)
    text = "The sea is calm today. The sky is clear and the sun is warm. The sky is blue."
    stops = ["sky is", "ky is c", "warm."][: 1 + seed % 3]
    first = min(text.find(s) for s in stops if s in text)
    cuts = sorted(set(rng.integers(1, len(text), size=rng.integers(1, 20)).tolist()))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    s = StopStrings(stops)
    printed = ""
    for p in pieces:
        printed += s.feed(p)
        assert text[:first].startswith(printed)  # never a character of a stop string
        if s.stopped:
            break
    printed += s.flush()
    assert printed == text[:first]


# Generation loop on a scripted model ----------------------------------------------
class Scripted(Capabilities):
    """A 'model' whose next token follows a script, whatever the input."""

    def __init__(self, script, vocab):
        self.script = list(script)
        self.args = SimpleNamespace(vocab_size=vocab)
        self.calls = 0
        self.engine = None  # the model contract's slot (generation.batch_engine)

    def make_cache(self):
        return None

    def __call__(self, inputs, cache):
        logits = np.full((1, inputs.shape[1], self.args.vocab_size), -10.0, np.float32)
        logits[0, -1, self.script[min(self.calls, len(self.script) - 1)]] = 10.0
        self.calls += 1
        return mx.array(logits)


def run_text(tok, text, **kw):
    script = tok.encode(text, add_special_tokens=False)
    model = Scripted(script, tok.vocab_size)
    gen = generate_text(model, tok, [tok.bos_id], kw.pop("max_tokens", len(script)), **kw)
    chunks = []
    while True:
        try:
            chunks.append(next(gen))
        except StopIteration as done:
            return chunks, done.value


def test_row_text_ends_at_eos_stop_or_length(tok):
    # the one rule generate and serve's scheduler apply to each id
    ids = tok.encode("The sea is calm. The sky is clear.", add_special_tokens=False)
    eos = tok.eos_ids[0]

    def run(row, feed):
        out = ""
        for t in feed:
            out += row.add(t)
            if row.reason:
                break
        return out + (row.close() if row.reason is None else "")

    row = RowText(tok, eos_ids=[eos])
    assert run(row, ids[:4] + [eos] + ids[4:]) == tok.decode(ids[:4]) and row.reason == "eos"
    assert row.generated == 4  # EOS is not counted
    row = RowText(tok, stop=["sky"], eos_ids=[eos])
    text = run(row, ids)
    assert text == "The sea is calm. The " and row.reason == "stop" and row.stopped == "sky"
    row = RowText(tok, max_tokens=3)
    assert run(row, ids) == tok.decode(ids[:3]) and row.reason == "length" and row.generated == 3
    row = RowText(tok)
    assert run(row, ids) == tok.decode(ids) and row.reason is None


def test_generation_stops_at_a_stop_string_split_across_tokens(tok):
    text = "The sea is calm. The sky is clear."
    chunks, stats = run_text(tok, text, stop=["sky is"])
    ids = tok.encode(text, add_special_tokens=False)
    # "sky is" spans several tokens
    assert not any("sky is" in tok.decode([i]) for i in ids)
    assert "".join(chunks) == "The sea is calm. The "
    # at every point, what was printed is a prefix of the text before the stop string
    assert all("The sea is calm. The ".startswith("".join(chunks[:k])) for k in range(len(chunks) + 1))
    assert stats.finish_reason == "stop" and stats.stop == "sky is"
    # generation ended with the token that completed the match
    assert tok.decode(stats.tokens[:-1]).find("sky is") == -1 and "sky is" in tok.decode(stats.tokens)


def test_generation_stops_at_eos_which_is_not_printed(tok):
    eos = tok.eos_ids[0]
    script = tok.encode("Calm.", add_special_tokens=False) + [eos] + tok.encode(" more", add_special_tokens=False)
    gen = generate_text(Scripted(script, tok.vocab_size), tok, [tok.bos_id], 50)
    out = []
    while True:
        try:
            out.append(next(gen))
        except StopIteration as done:
            stats = done.value
            break
    assert "".join(out) == "Calm." and stats.finish_reason == "eos" and stats.tokens[-1] == eos


def test_generation_streams_utf8_whole_and_respects_max_tokens(tok):
    chunks, stats = run_text(tok, "café 🌊 日本", max_tokens=6)
    assert all("\ufffd" not in c for c in chunks[:-1])
    assert stats.generated == 6 and stats.finish_reason == "length"
    full, _ = run_text(tok, "café 🌊 日本")
    assert "".join(full) == "café 🌊 日本"


def test_rank_agreement_guard_runs_at_np1():
    # One rank: the check runs its code path without a collective and passes.
    g = RankAgreement(SINGLE, every=4)
    for t in range(10):
        g.add(t)
    g.finish()
    assert g.checks == 3 and g.checked == 10
    assert SINGLE.gather_rows([1, 2]).tolist() == [[1.0, 2.0]]
    with pytest.raises(UserError, match="--check-every must be >= 0"):
        RankAgreement(SINGLE, every=-1)


def test_generation_counts_checks(tok):
    model = Scripted(tok.encode("The sea is calm.", add_special_tokens=False), tok.vocab_size)
    gen = Generation(model, [tok.bos_id], 7, check_every=3)
    ids = list(gen)
    stats = gen.finish()
    assert len(ids) == 7 and stats.checks == 3  # after 3, 6, and the end


# Chat templates ---------------------------------------------------------------------
TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = none %}{% set msgs = messages %}{% endif %}\n"
    "{% for m in msgs %}\n"
    "  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}\n"
    "<|{{ m['role'] }}|>\n"
    "  {% if loop.first and sys %}{{ sys | tojson }}\n\n{% endif %}\n"
    "  {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}{% endif %}{{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me about the sea."}],
    [{"role": "system", "content": "Be brief — café 🌊."}, {"role": "user", "content": "  Hi  "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "And the sky?"}],
]


def _no_template_copy(d):
    """A copy of the embedded model without its chat template."""
    shutil.copytree(TINY, d)
    (d / "chat_template.jinja").unlink()
    return d


@pytest.fixture
def chat_ckpt(tmp_path):
    d = _no_template_copy(tmp_path / "chat")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


def test_chat_template_renders_as_expected(chat_ckpt):
    t = Tokenizer(chat_ckpt)
    assert t.render_chat(CONVERSATIONS[1]) == '<bos><|user|>\n"Be brief — café 🌊."\n\nHi<eos>\n<|assistant|>\n'
    ids = t.prompt_ids("Hi", chat=True, system="Be brief — café 🌊.")
    assert ids == t.encode(t.render_chat(CONVERSATIONS[1]), add_special_tokens=False)
    assert ids[0] == t.bos_id and ids.count(t.bos_id) == 1  # the template's BOS, none added
    with pytest.raises(UserError, match="Unknown role: tool"):
        t.render_chat([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(chat_ckpt, conv, gen_prompt):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(chat_ckpt))
    ours = Tokenizer(chat_ckpt)
    want = ref.apply_chat_template(conv, add_generation_prompt=gen_prompt, tokenize=False)
    assert ours.render_chat(conv, add_generation_prompt=gen_prompt) == want
    want_ids = ref.apply_chat_template(conv, add_generation_prompt=gen_prompt, tokenize=True, return_dict=False)
    assert ours.chat_ids(conv, add_generation_prompt=gen_prompt) == list(want_ids)


# apply_chat_template, recorded (scripts/make_transformers_fixtures.py): the
# comparison above without transformers, over more templates and conversations
HF_CHAT = json.loads((HF_FIXTURES / "chat_templates.json").read_text())


def _hf_chat_ckpt(d, layout):
    """A copy of the embedded model whose tokenizer carries the templates as
    the recording script laid them out."""
    templates = HF_CHAT["templates"]
    _no_template_copy(d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    t = layout.get("tokenizer_config")
    if isinstance(t, str):
        tc["chat_template"] = templates[t]
    elif isinstance(t, list):
        tc["chat_template"] = [{"name": n, "template": templates[src]} for n, src in t]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    if "chat_template.jinja" in layout:
        (d / "chat_template.jinja").write_text(templates[layout["chat_template.jinja"]])
    return d


@pytest.fixture(scope="module")
def hf_chat_tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_chat")
    return {name: Tokenizer(_hf_chat_ckpt(root / name, {"tokenizer_config": name})) for name in HF_CHAT["templates"]}


def test_recorded_chat_cases_include_this_files_template():
    assert HF_CHAT["templates"]["test"] == TEMPLATE
    assert list(HF_CHAT["conversations"].values())[:3] == CONVERSATIONS
    assert {c["template"] for c in HF_CHAT["cases"]} == set(HF_CHAT["templates"])
    assert any("error" in c for c in HF_CHAT["cases"])


@pytest.mark.parametrize("case", HF_CHAT["cases"], ids=lambda c: "{template}-{conversation}-{add_generation_prompt}"
                         .format(**c))
def test_chat_template_matches_recorded_transformers(hf_chat_tokenizers, case):
    t = hf_chat_tokenizers[case["template"]]
    conv, gen = HF_CHAT["conversations"][case["conversation"]], case["add_generation_prompt"]
    if "error" in case:  # transformers refused it: so do we, with the template's message
        with pytest.raises(UserError) as e:
            t.render_chat(conv, add_generation_prompt=gen)
        assert case["error"] in str(e.value)
        return
    assert t.render_chat(conv, add_generation_prompt=gen) == case["text"]
    assert t.chat_ids(conv, add_generation_prompt=gen) == case["ids"]


@pytest.mark.parametrize("name", list(HF_CHAT["layouts"]))
def test_chat_template_source_matches_recorded_transformers(tmp_path, name):
    # which template a checkpoint with several uses
    case = HF_CHAT["layouts"][name]
    t = Tokenizer(_hf_chat_ckpt(tmp_path / name, case["files"]))
    conv = HF_CHAT["conversations"]["multi_turn"]
    assert t.render_chat(conv) == case["text"]
    assert t.chat_ids(conv) == case["ids"]


def test_chat_template_jinja_file_wins(chat_ckpt):
    (chat_ckpt / "chat_template.jinja").write_text("{{ bos_token }}Q: {{ messages[-1]['content'] }}\nA:")
    t = Tokenizer(chat_ckpt)
    assert t.render_chat(CONVERSATIONS[0]) == "<bos>Q: Tell me about the sea.\nA:"
    assert t.chat_template()[1].endswith("chat_template.jinja")


def test_chat_template_errors(tmp_path):
    with pytest.raises(UserError, match="syntax error"):
        render_chat_template("{% if %}", [])
    bare = Tokenizer(_no_template_copy(tmp_path / "bare"))
    with pytest.raises(UserError, match="has no chat template"):
        bare.prompt_ids("Hi", chat=True)
    for tok, chat in ((bare, None), (Tokenizer(TINY), False)):
        with pytest.raises(UserError, match="--system-prompt is a chat-template turn"):
            tok.prompt_ids("Hi", chat=chat, system="x")


def test_chat_template_is_the_default_when_there_is_one(tmp_path):
    # mlx-lm's habit: the checkpoint's template unless --ignore-chat-template;
    # plain text without one; --chat-template supplies one.
    tiny, bare = Tokenizer(TINY), Tokenizer(_no_template_copy(tmp_path / "bare"))
    assert tiny.use_chat(None) and not bare.use_chat(None) and not tiny.use_chat(False)
    assert tiny.prompt_ids("The sea") == tiny.chat_ids([{"role": "user", "content": "The sea"}])
    assert bare.prompt_ids("The sea") == bare.encode("The sea")
    own = Tokenizer(bare.model_dir, chat_template="{{ bos_token }}Q: {{ messages[-1]['content'] }}\nA:")
    assert own.use_chat(None) and own.chat_template()[1] == "--chat-template"
    assert own.prompt_ids("Hi") == own.encode("Q: Hi\nA:")


def test_eos_ids_are_the_union_of_every_source(tmp_path):
    d = tmp_path / "eos"
    shutil.copytree(TINY, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = 9
    (d / "config.json").write_text(json.dumps(cfg))
    assert Tokenizer(d).eos_ids == [1, 7, 9]


# The generate command -----------------------------------------------------------------
def test_generate_greedy_default_model():
    r = run("generate", "-n", "40", "--ignore-chat-template")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(GREEDY_SEA[:100])
    # Through the embedded model's chat template (the default): the same
    # continuation (its template is the text itself), the prompt not echoed.
    chat = run("generate", "-n", "40", "--verbose")
    assert chat.exit_code == 0, chat.output
    assert chat.stdout.startswith(GREEDY_SEA[len("The sea"):100]) and "chat template: " in chat.stderr


def test_generate_mlx_lm_spellings(tmp_path):
    # --model, -m, --system-prompt, --prefill-step-size, -p - (stdin), -h, --version
    r = run("generate", "--model", str(TINY), "-m", "12", "--ignore-chat-template", "--prefill-step-size", "2",
            "-p", "-", input="The sea")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(GREEDY_SEA[:30])
    r = run("generate", "-m", "3", "--system-prompt", "Be brief.", "-p", "Hi", "--verbose")
    assert r.exit_code == 0 and "chat template: " in r.stderr, r.output
    assert run("generate", str(TINY), "--model", "other").stderr.startswith("error: MODEL")
    assert "Usage" in run("generate", "-h").stdout
    assert run("--version").stdout.startswith("mlxcel-dist ")


def test_generate_seed_is_random_unless_given():
    args = ["generate", "-n", "24", "--temp", "1.5", "--ignore-chat-template", "--verbose"]
    runs = [run(*args) for _ in range(3)]
    seeds = [re.search(r"seed (\d+)", r.stderr).group(1) for r in runs]
    assert all(r.exit_code == 0 for r in runs) and len(set(seeds)) == 3, [r.stderr for r in runs]
    again = run(*args, "--seed", seeds[0])  # the seed --verbose printed reproduces the text
    assert again.stdout == runs[0].stdout


def test_generate_refuses_text_that_is_not_utf8_and_prompts_past_the_context():
    import subprocess

    bad = subprocess.run([sys.executable, "-m", "mlxcel_dist.cli", "generate", "-p", "-"], input=b"\xffThe sea",
                         capture_output=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.decode().splitlines() == [
        "error: the prompt on stdin is not valid UTF-8 (byte 0xff at offset 0)"]
    arg = subprocess.run([sys.executable, "-m", "mlxcel_dist.cli", "generate", "-p", b"\xfe abc"],
                         capture_output=True, timeout=120)
    assert arg.returncode == 2 and b"--prompt is not valid UTF-8 (byte 0xfe" in arg.stderr
    long = run("generate", "-p", "The sea is calm. " * 120, "-m", "64")
    assert long.exit_code == 2 and "more than the model's context of 512" in long.stderr, long.output


def test_generate_stop_string_and_verbose():
    r = run("generate", "-n", "60", "--stop", "sky", "--stop", "zzz", "--verbose", "--ignore-chat-template")
    assert r.exit_code == 0, r.output
    assert r.stdout == "The sea is calm today. The \n"
    assert "finished by stop string 'sky'" in r.stderr
    assert "MLX peak MiB" in r.stderr and "\n   0 " in r.stderr


def test_generate_seeded_sampling_is_reproducible():
    args = ["generate", "-n", "30", "--temp", "0.9", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.02",
            "--repetition-penalty", "1.1", "--repetition-context-size", "16"]
    a, b, c = run(*args, "--seed", "5"), run(*args, "--seed", "5"), run(*args, "--seed", "6")
    assert a.exit_code == 0, a.output
    assert a.stdout == b.stdout and a.stdout != c.stdout


def test_generate_chat(chat_ckpt):
    r = run("generate", chat_ckpt, "--chat", "--system", "Be brief.", "-p", "Hi", "-n", "5", "--verbose")
    assert r.exit_code == 0, r.output
    assert "chat template: " in r.stderr and "<|user|>" not in r.stdout
    bare = run("generate", _no_template_copy(chat_ckpt.parent / "bare"), "--chat", "-p", "Hi")
    assert bare.exit_code == 2 and "has no chat template" in bare.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temp", "-1"], "--temp must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.01"], "--top-p must be in (0, 1]"),
        (["--top-k", "-3"], "--top-k must be an integer >= 0"),
        (["--min-p", "2"], "--min-p must be in [0, 1]"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
        (["--repetition-context-size", "-1"], "--repetition-context-size must be >= 0"),
        (["--seed", "-1"], "--seed must be in [0, 2^64)"),
        (["--max-tokens", "-1"], "--max-tokens must be >= 0"),
        (["--check-every", "-1"], "--check-every must be >= 0"),
        (["--stop", ""], "--stop must not be empty"),
        (["--ignore-chat-template", "--system", "x"], "--system-prompt is a chat-template turn"),
        (["--chat-template", "{% if %}"], "syntax error"),
        (["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja: no such file"),
        (["--np", "2", "--temp", "-1"], "--temp must be >= 0"),  # refused before launching
    ],
)
def test_generate_bad_input_is_one_line(args, message):
    r = run("generate", *args)
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    assert r.stderr.startswith("error: ") and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


# Real launcher: 2 MPI ranks -----------------------------------------------------------------
def _cli():
    exe = Path(sys.executable).parent / "mlxcel-dist"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mlxcel_dist.cli"]


def _generate(cwd, *args, env=None):
    return run_cmd(_cli() + ["generate", *map(str, args)], timeout=300,
                          cwd=cwd, env=env)


def test_np2_prints_the_same_text_as_np1(tmp_path):
    args = ["-p", "The sea", "-n", "120"]  # through the embedded model's chat template (the default)
    one = _generate(tmp_path, *args)
    two = _generate(tmp_path, *args, "--np", "2", "--backend", "mpi")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert one.stdout.startswith(GREEDY_SEA[len("The sea"):])
    assert two.stdout == one.stdout


def test_np2_sampling_ranks_agree_and_verbose_reports_each_rank(tmp_path):
    p = _generate(tmp_path, "-n", "48", "--temp", "0.9", "--top-k", "30", "--top-p", "0.9", "--min-p", "0.05",
                  "--repetition-penalty", "1.1", "--seed", "3", "--stop", "-x", "--verbose",
                  "--np", "2", "--backend", "mpi")
    assert p.returncode == 0, p.stderr
    assert "ranks agreed at" in p.stderr
    rows = [line.split() for line in p.stderr.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [r[0] for r in rows] == ["0", "1"] and all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows), p.stderr


def test_np2_divergent_ranks_abort_with_one_clear_error(tmp_path):
    # Fault hook: the last rank samples with another seed.
    env = dict(os.environ, MLXCEL_DIST_INJECT_FAULT="sampler-seed")
    p = _generate(tmp_path, "-n", "60", "--temp", "3", "--np", "2", "--backend", "mpi", env=env)
    assert p.returncode == 3, p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "ranks diverged after" in errors[0], p.stderr
    assert "Traceback" not in p.stderr


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    import shutil

    from mlxcel_dist.checkpoint.loader import default_model_dir

    d = tmp_path / "m"
    shutil.copytree(default_model_dir(), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 100  # the tokenizer has 512 tokens
    (d / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["generate", str(d), "-n", "2"])
    assert r.exit_code == 2, r.output
    assert "the tokenizer has 512 tokens but the model's vocabulary is 100" in r.output
