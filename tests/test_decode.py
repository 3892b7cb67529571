"""The decode hot path (generation.Generation, the engine's one row): the pipelined loop draws what
a plain one-step-at-a-time loop draws (sampling with a repetition penalty
whose last context id is still on the device), chunked prefill gives the same
ids as one chunk on a prompt several windows long, compiled decode steps are
traced once and give the eager caches' logits,
and the device-side agreement row equals the host's."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.parallel.collectives import SINGLE, Group
from mlxcel_dist.engine.guard import RankAgreement
from mlxcel_dist.engine.generation import Generation, sequence_logits
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.models import MODEL_REMAP, supported
from mlxcel_dist.engine.sampling import Sampler, SamplingParams, apply_repetition_penalty

from reference_cases import FIXTURES, case_id, cases


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


def test_openai_penalties_and_logit_bias_follow_their_definitions():
    """logit bias, then presence / frequency over the generated ids only (the
    prompt's first ids are not counted), the unread id counted as generated."""
    from mlxcel_dist.engine.sampling import penalized

    rng = np.random.default_rng(3)
    x = rng.normal(size=32).astype(np.float32)
    prompt, generated = [3, 3, 8], [5, 5, 5, 9, 3]
    p = SamplingParams(presence_penalty=0.4, frequency_penalty=0.25, logit_bias=((9, 7.0), (20, -3.0)))
    want = x.astype(np.float64).copy()
    want[9] += 7.0
    want[20] -= 3.0
    counts = np.bincount(generated + [12], minlength=32)  # 12: the pending id
    want -= 0.25 * counts + 0.4 * (counts > 0)
    got = penalized(mx.array(x), prompt + generated, p, pending=mx.array(12, mx.int32), prompt_len=len(prompt))
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=1e-6)
    # a logit bias of +100 makes greedy pick that token
    s = Sampler(SamplingParams(logit_bias=((17, 100.0),)), prompt_len=0)
    assert s(mx.array(x), []) == 17
    with pytest.raises(Exception, match="presence_penalty must be in"):
        SamplingParams(presence_penalty=2.5).validate()
    with pytest.raises(Exception, match="logit_bias must be values in"):
        SamplingParams(logit_bias=((1, 101.0),)).validate()


def plain_loop(model, prompt, n, params):
    """One step at a time, the host reading each id before the next step; the
    prompt fed as the generator feeds it (all but the last token, then the last)."""
    sampler, cache, ctx = Sampler(params, len(prompt)), model.make_cache(), list(prompt)
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
    SamplingParams(presence_penalty=1.2, frequency_penalty=0.8, logit_bias=((5, 2.0), (9, -1.0))),
    SamplingParams(temp=0.9, seed=5, presence_penalty=-0.5, frequency_penalty=1.5),
], ids=["greedy", "greedy-penalty", "sampled-penalty-window", "sampled", "greedy-openai-penalties",
        "sampled-openai-penalties"])
def test_pipelined_loop_draws_what_a_plain_loop_draws(tiny, params):
    prompt = np.random.default_rng(1).integers(4, tiny.args.vocab_size, 20)
    gen = Generation(tiny, prompt, 24, params)
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
    one = list(Generation(model, prompt, 8, prefill_step=len(prompt)))
    for step in (5, 16, 19):
        assert list(Generation(model, prompt, 8, prefill_step=step)) == one, step


def test_decode_steps_are_traced_once(monkeypatch):
    # The compiled step's graph (its masks included) is built on the host once
    # per buffer shape, not once per token; the eager step builds it per token.
    # (A fresh model: a model's traces are kept for its later generations.)
    tiny = load_model(default_model_dir()).model
    stack = tiny.model
    seen = []
    orig = stack.masks
    monkeypatch.setattr(stack, "masks", lambda L, cache: seen.append((L, m := orig(L, cache))) or m)

    compiled = list(Generation(tiny, np.arange(4, 44), 12, prefill_step=16))
    # 39 prompt tokens in chunks of 16, then one trace for all 12 single-token
    # steps (the one-row split step builds no mask; a whole-graph one builds it once)
    assert [L for L, _ in seen if L > 1] == [16, 16, 7] and len(seen) <= 4
    assert tiny.engine.traces == 1 and tiny.engine.splits(1)
    seen.clear()
    eager = list(Generation(tiny, np.arange(4, 44), 12, prefill_step=16, compiled=False))
    assert [L for L, _ in seen] == [16, 16, 7] + [1] * 12
    assert compiled == eager
    seen.clear()
    assert list(Generation(tiny, np.arange(4, 44), 12, prefill_step=16)) == compiled
    assert [L for L, _ in seen] == [16, 16, 7]  # the same shapes again: the kept trace
    assert tiny.engine.traces == 1


def test_buffers_grow_only_when_full():
    # Prompt 1024: the buffer is sized for 1025 + a quarter, rounded up to the
    # CPU's 64 slots (1344); the decode steps after it fit, so one trace serves
    # them all (a regrowth would retrace).
    tiny = load_model(default_model_dir()).model
    gen = Generation(tiny, np.arange(1024) % 500, 8)
    for i, _ in enumerate(gen):
        if i == 6:
            held = max(v.shape[2] for k, v in tiny.engine.buffers.items() if k != "pos")
    gen.finish()
    assert tiny.engine.traces == 1
    assert held == 1344  # (sliding layers: their window)


def test_finished_generation_leaves_no_kv_buffers(tiny):
    # the engine stays on the model between generations; its buffers do not
    gen = Generation(tiny, np.arange(4, 30), 5)
    for i, _ in enumerate(gen):
        if i == 2:
            assert len(tiny.engine.buffers) > 0  # the row's buffers, while it generates
    gen.finish()
    assert len(tiny.engine.buffers) == 0 and len(tiny.engine) == 0
    sequence_logits(tiny, np.arange(4, 30), decode_from=20)  # (its decode part: a row of the engine too)
    assert len(tiny.engine.buffers) == 0 and len(tiny.engine) == 0


def eager_logits(model, ids, start):
    """Logits of ids[start:], one token at a time through the growing eager caches."""
    cache = model.make_cache()
    model(mx.array(ids[:start])[None], cache)
    return np.stack([np.array(model(mx.array([[int(t)]]), cache)[0, -1].astype(mx.float32)) for t in ids[start:]])


# Per registered family, its first fp32 case and its first half-precision
# one: a new family's fixtures are covered here without a hand edit (every
# case of every family runs through the same decode path in test_reference).
def _static_cases() -> list:
    picked = {}
    for d in sorted(cases(), key=lambda d: not d.name.startswith("gqa")):  # GQA (windowed) cases first
        if d.parent.name in supported():
            picked.setdefault((d.parent.name, "fp32" in d.name), case_id(d))
    return sorted(picked.values())


STATIC_CASES = _static_cases()


def test_every_registered_model_type_has_reference_fixtures():
    # A model_type is covered by its own fixtures or by those of the file it maps to.
    families = {d.parent.name for d in cases()}
    missing = [t for t in supported() if t not in families and MODEL_REMAP.get(t, t) not in families]
    assert not missing, f"registered model_types without tests/fixtures/<family>/: {missing}"


@pytest.mark.parametrize("case", STATIC_CASES)
@pytest.mark.parametrize("start", [1, 23])
def test_static_decode_matches_the_eager_caches(case, start, monkeypatch):
    # Buffers of 8 slots: decode crosses several regrowths (a retrace each) and
    # wraps the sliding layers' rings (windows 8 and 16), from a one-token
    # prompt and from one longer than the window.
    import mlxcel_dist.engine.decode as decode

    monkeypatch.setattr(decode, "STEP", 8)
    d = FIXTURES / case
    model = load_model(d).model
    ids = np.load(d / "reference.npz")["ids"]
    assert len(ids) - start > 3 * 8, len(ids)
    want = eager_logits(model, ids, start)
    # the uncompiled static step (--no-compile) from the longer prompt only: the same buffers and views
    for compiled in (True, False) if start > 1 else (True,):
        got = sequence_logits(model, ids, decode_from=start, compiled=compiled)[start:]
        # the same keys in another buffer layout: equal up to summation order
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"{case} {compiled}")


def test_device_agreement_row_is_the_host_row(monkeypatch):
    # A 2-rank group seen from rank 0, the all_sum an identity: row 0 is
    # what this rank contributes, computed on the device from the lazy id.
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None: x)
    group = Group(SimpleNamespace(size=lambda: 2, rank=lambda: 0))
    g = RankAgreement(group, every=1)
    host = RankAgreement(SINGLE, every=1)
    for tok in [5, 0, 262143, 17, 2**20, 3] * 5:
        rows = np.array(g.pending_rows(mx.array(tok, mx.int32)))
        host.add(tok)
        assert rows[0].tolist() == [host.count, host.checksum, host.last] and not rows[1].any()
        g.count, g.checksum, g.last, g.checked = host.count, host.checksum, host.last, host.count
    g2 = RankAgreement(group, every=3)
    assert g2.pending_rows(mx.array(1, mx.int32)) is None  # no check due at the first id


def test_first_step_of_a_new_graph_is_announced_and_timed_apart(monkeypatch):
    # The last prompt token's step builds (and compiles) the decode graph: the
    # generator announces it (on_compile, from a timer; here a timer that
    # fires at once) and reports its time as compile_s, not prompt speed. The
    # same shapes again reuse the graph: nothing announced, every token timed.
    import mlxcel_dist.engine.generation as generation

    class FiresAtOnce:
        def __init__(self, _delay, fn):
            self.fn, self.daemon = fn, False

        def start(self):
            self.fn()

        def cancel(self):
            pass

    monkeypatch.setattr(generation.threading, "Timer", FiresAtOnce)
    model = load_model(default_model_dir()).model  # fresh: no graph traced yet
    prompt = np.arange(4, 11)
    calls = []
    first = Generation(model, prompt, 4, on_compile=lambda: calls.append(1))
    list(first)
    s1 = first.finish()
    assert calls == [1] and s1.compile_s > 0 and s1.prefill_timed_tokens == len(prompt) - 1
    assert s1.ttft_s == s1.prefill_s + s1.compile_s
    again = Generation(model, prompt, 4, on_compile=lambda: calls.append(2))
    list(again)
    s2 = again.finish()
    assert calls == [1] and s2.compile_s == 0 and s2.prefill_timed_tokens == len(prompt)
