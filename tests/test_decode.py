"""The decode hot path (engine.TokenGenerator): the pipelined loop draws what
a plain one-step-at-a-time loop draws (sampling with a repetition penalty
whose last context id is still on the device), chunked prefill gives the same
ids as one chunk on a prompt several windows long, decode steps build no mask,
and the device-side agreement row equals the host's."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.engine import RankAgreement, TokenGenerator
from mlxcel_dist.loader import default_model_dir, load_model
from mlxcel_dist.sampling import Sampler, SamplingParams, apply_repetition_penalty

from reference_cases import FIXTURES


@pytest.fixture(scope="module")
def tiny():
    return load_model(default_model_dir()).model


@pytest.mark.parametrize("size", [0, 1, 2, 5, 50])
def test_pending_id_joins_the_repetition_penalty(size):
    x = np.random.default_rng(size).normal(size=64).astype(np.float32) * 3
    ctx = [3, 7, 7, 9, 11, 40]
    for pending in (7, 12):
        want = apply_repetition_penalty(mx.array(x), ctx + [pending], 1.7, size)
        got = apply_repetition_penalty(mx.array(x), ctx, 1.7, size, pending=mx.array(pending, mx.int32))
        np.testing.assert_array_equal(np.array(got), np.array(want))
    got = apply_repetition_penalty(mx.array(x), [], 1.7, size, pending=mx.array(5, mx.int32))
    np.testing.assert_array_equal(np.array(got), np.array(apply_repetition_penalty(mx.array(x), [5], 1.7, size)))


def plain_loop(model, prompt, n, params):
    """One step at a time, the host reading each id before the next step; the
    prompt fed as the generator feeds it (all but the last token, then the last)."""
    sampler, cache, ctx = Sampler(params), model.make_cache(), list(prompt)
    model(mx.array(prompt[:-1])[None], cache)
    logits = model(mx.array(prompt[-1:])[None], cache)
    out = []
    for _ in range(n):
        tok = sampler(logits[0, -1], ctx)
        out.append(tok)
        ctx.append(tok)
        logits = model(mx.array([[tok]]), cache)
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(temp=0.9, top_k=20, repetition_penalty=1.3, repetition_context_size=3, seed=7),
    SamplingParams(temp=1.2, top_p=0.9, min_p=0.05, seed=3),
], ids=["greedy", "greedy-penalty", "sampled-penalty-window", "sampled"])
def test_pipelined_loop_draws_what_a_plain_loop_draws(tiny, params):
    prompt = np.random.default_rng(1).integers(4, tiny.args.vocab_size, 20)
    gen = TokenGenerator(tiny, prompt, 24, params)
    ids = list(gen)
    stats = gen.finish()
    assert ids == plain_loop(tiny, prompt, 24, params)
    assert stats.generated == 24 and stats.checks == 24


def test_chunked_prefill_gives_the_ids_of_one_chunk():
    # Several windows long (window 16): chunks below, at and above the window.
    d = FIXTURES / "gemma3" / "gqa_fp32"
    model = load_model(d).model
    prompt = np.load(d / "reference.npz")["ids"]
    assert len(prompt) > 3 * model.args.sliding_window
    one = list(TokenGenerator(model, prompt, 8, prefill_step=len(prompt)))
    for step in (5, 16, 19):
        assert list(TokenGenerator(model, prompt, 8, prefill_step=step)) == one, step


def test_decode_steps_build_no_mask(tiny, monkeypatch):
    stack = tiny.model
    seen = []
    orig = stack.masks
    monkeypatch.setattr(stack, "masks", lambda L, cache: seen.append((L, m := orig(L, cache))) or m)
    gen = TokenGenerator(tiny, np.arange(4, 44), 12, prefill_step=16)
    ids = list(gen)
    assert len(ids) == 12
    # 39 prompt tokens in chunks of 16, then one single-token step per generated id
    assert [L for L, _ in seen] == [16, 16, 7] + [1] * 12
    assert all(m is None for L, ms in seen if L == 1 for m in ms.values())


def test_device_agreement_row_is_the_host_row(monkeypatch):
    # A 2-rank group seen from rank 0, the all_sum an identity: row 0 is
    # what this rank contributes, computed on the device from the lazy id.
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None: x)
    group = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    g = RankAgreement(group, every=1)
    host = RankAgreement(None, every=1)
    for tok in [5, 0, 262143, 17, 2**20, 3] * 5:
        rows = np.array(g.pending_rows(mx.array(tok, mx.int32)))
        host.add(tok)
        assert rows[0].tolist() == [host.count, host.checksum, host.last] and not rows[1].any()
        g.count, g.checksum, g.last, g.checked = host.count, host.checksum, host.last, host.count
    g2 = RankAgreement(group, every=3)
    assert g2.pending_rows(mx.array(1, mx.int32)) is None  # no check due at the first id
