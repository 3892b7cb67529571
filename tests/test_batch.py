"""Batched decoding (batch.BatchEngine): a request's tokens are the same
whether it runs alone or beside others that join and leave, for every
registered family (static buffers of every cache kind: KV, recurrent, conv
and DeltaNet state; quantized KV in tests/test_kv.py),
greedy and seeded sampling alike."""

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.engine import prefill
from mlxcel_dist.engine.batch import BatchEngine
from mlxcel_dist.engine.batch_step import Steps
from mlxcel_dist.engine.prefill import Together
from mlxcel_dist.engine.generation import Generation
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.models import supported
from mlxcel_dist.engine.sampling import SamplingParams

from reference_cases import case_id, cases

# One case per registered family (its first fp32 case), plus the embedded model.
FAMILY_CASES = {}
for d in cases():
    if d.parent.name in supported() and "fp32" in d.name:
        FAMILY_CASES.setdefault(d.parent.name, d)
CASES = [default_model_dir()] + list(FAMILY_CASES.values())


def alone_ids(model, prompt, n, sampling=None, **kw) -> list:
    """A request's ids alone: the engine's one row (generate's Generation), token by
    token also for a model with its own generation loop."""
    engine = BatchEngine(model) if model.own_loop else None
    return list(Generation(model, prompt, n, sampling, eos_ids=(), engine=engine, **kw))


def _ids(d):
    return "default" if d == default_model_dir() else case_id(d)


@pytest.fixture(autouse=True)
def small_buffers(monkeypatch):
    # Buffers of 8 slots: the steps cross regrowths and sliding rings wrap.
    import mlxcel_dist.engine.batch as batch
    import mlxcel_dist.engine.decode as decode

    monkeypatch.setattr(decode, "STEP", 8)
    monkeypatch.setattr(batch, "CPU_STEP", 8)


def _run_batched(model, prompts, params, n, joins, micro=1, schedule=None):
    """Rows join at the steps in `joins` (request i at joins[i]) and leave
    after n tokens; returns each request's ids. `micro`: the steps go in that
    many micro-batches (what --pp stages do); `schedule(step)`: each step's
    own (`BatchEngine.step`'s micro, as serve's MicroParts asks)."""
    eng = BatchEngine(model)
    eng.micro = micro
    got = {i: [] for i in range(len(prompts))}
    step = 0
    while True:
        for i, at in enumerate(joins):
            if at == step:
                eng.add(i, prompts[i], params[i])
        out = eng.step(micro=schedule(step) if schedule else 0)
        for rid, tok in out.items():
            got[rid].append(tok)
            if len(got[rid]) == n:
                eng.remove(rid)
        step += 1
        if not len(eng) and step > max(joins):
            return got, eng


@pytest.mark.parametrize("d", CASES, ids=_ids)
def test_batched_rows_decode_as_they_would_alone(d):
    model = load_model(d).model
    V = model.args.vocab_size
    rng = np.random.default_rng(0)
    # a one-token prompt, short ones, and prompts past the sliding window
    prompts = [rng.integers(3, V, k) for k in (5, 1, 40, 17, 70)]
    # row 1: OpenAI's penalties and a logit bias (greedy, so not the one batched argmax)
    params = [SamplingParams(), SamplingParams(presence_penalty=1.5, frequency_penalty=0.7, logit_bias=((4, 3.0),)),
              SamplingParams(temp=0.9, top_k=20, seed=7),
              SamplingParams(repetition_penalty=1.3), SamplingParams(temp=1.1, top_p=0.9, seed=3)]
    n = 20
    alone = [alone_ids(model, p, n, s) for p, s in zip(prompts, params)]
    got, eng = _run_batched(model, prompts, params, n, joins=[0, 0, 3, 7, 9])
    assert [got[i] for i in range(len(prompts))] == alone
    if eng.static:
        assert eng.buffers == {}  # the last row's removal dropped the buffers
        # a few graphs (per row count and buffer length), not one per step
        assert 1 <= eng.traces < 12


MICRO_CASES = [default_model_dir()] + [FAMILY_CASES[f] for f in ("gemma3n", "gemma2", "llama") if f in FAMILY_CASES]


@pytest.mark.parametrize("d", MICRO_CASES, ids=_ids)
@pytest.mark.parametrize("micro", [3])  # 3 parts of 4- or 8-row steps: uneven parts, one of them pads only
def test_micro_batched_steps_decode_as_rows_alone(d, micro):
    # serve over pipeline stages splits each step's rows into micro-batches
    # (batch_step._launch_micro: a forward per part, each writing its own rows of
    # the shared buffers); rows joining and leaving move between parts and
    # capacities, greedy and sampled rows mixed, sliding rings wrapping
    model = load_model(d).model
    V = model.args.vocab_size
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, V, k) for k in (5, 1, 40, 17, 70)]
    params = [SamplingParams(), SamplingParams(temp=0.9, top_k=20, seed=7), SamplingParams(),
              SamplingParams(repetition_penalty=1.3), SamplingParams()]
    n = 14
    alone = [alone_ids(model, p, n, s) for p, s in zip(prompts, params)]
    got, eng = _run_batched(model, prompts, params, n, joins=[0, 0, 3, 5, 6], micro=micro)
    assert [got[i] for i in range(len(prompts))] == alone
    greedy = [alone_ids(model, p, n, SamplingParams()) for p in prompts]
    got, _ = _run_batched(model, prompts, [SamplingParams()] * 5, n, joins=[0, 0, 0, 2, 2], micro=micro)
    assert [got[i] for i in range(len(prompts))] == greedy  # all greedy: the per-part argmax path


def test_steps_switching_between_micro_batches_and_whole_decode_as_rows_alone():
    # serve's MicroParts picks each step's micro-batches by the steps' times: a step
    # in parts may follow a whole one and the other way round (its inputs the unread
    # ids of a step launched the other way), with rows joining and leaving
    model = load_model(default_model_dir()).model
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.args.vocab_size, k) for k in (5, 1, 40, 17, 70)]
    params = [SamplingParams(), SamplingParams(temp=0.9, top_k=20, seed=7), SamplingParams(),
              SamplingParams(repetition_penalty=1.3), SamplingParams()]
    n = 14
    alone = [alone_ids(model, p, n, s) for p, s in zip(prompts, params)]
    modes = [3, 3, 1, 3, 1, 1, 2, 3]  # 2: fewer parts than the engine's 3
    micro, started = Steps._launch_micro, []

    def timed(steps, *a):  # serve's step log: MLX's start is timed inside a micro-batched launch too
        before = steps.clock["eval"]
        micro(steps, *a)
        started.append(steps.clock["eval"] > before)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Steps, "_launch_micro", timed)
        got, eng = _run_batched(model, prompts, params, n, joins=[0, 0, 3, 5, 6], micro=3,
                                schedule=lambda s: modes[s % len(modes)])
    assert [got[i] for i in range(len(prompts))] == alone
    assert 0 < eng.micro_steps < 2 * n  # both kinds of step ran (about 30 steps in all)
    assert len(started) == eng.micro_steps and all(started)
    assert 0 < eng.steps.clock["eval"] < eng.steps.clock["launch"], eng.steps.clock


def test_warmup_compiles_every_capacity_once_and_changes_nothing(monkeypatch):
    """After warmup(8) batches of 1-8 rows trace nothing new, and their ids
    are a cold engine's; the warm-up leaves no row and no prompt-cache entry.
    (Buffers of 64 slots: these rows never regrow them, a new shape the
    warm-up does not cover.)"""
    import mlxcel_dist.engine.batch as batch
    import mlxcel_dist.engine.decode as decode
    from mlxcel_dist.engine.prompt_cache import PromptCache

    monkeypatch.setattr(batch, "CPU_STEP", 64)
    monkeypatch.setattr(decode, "STEP", 64)
    model = load_model(default_model_dir()).model
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, model.args.vocab_size, k) for k in (5, 3, 7, 4, 6)]
    params = [SamplingParams(temp=0.0)] * 4 + [SamplingParams(temp=0.8, seed=5)]
    cold, cold_eng = _run_batched(model, prompts, params, 12, joins=[0, 0, 2, 5, 5])
    warm = BatchEngine(model, prompt_cache=PromptCache(4, 1 << 30))
    done = warm.warmup(8)
    assert [c for c, _ in done] == [1, 2, 4, 8] and warm.traces >= 4
    assert len(warm) == 0 and not warm.buffers and not warm.prompt_cache.entries
    traces = warm.traces
    got = {i: [] for i in range(len(prompts))}
    for n in (1, 3, 5):  # capacities 1, 4, 8
        for i in range(n):
            warm.add(i, prompts[i], params[i])
        for _ in range(12):
            for rid, tok in warm.step().items():
                got[rid].append(tok)
        for i in range(n):
            warm.remove(i)
        while warm.step():
            pass
        assert all(got[i] == cold[i] for i in range(n)), (n, got, cold)
        got = {i: [] for i in range(len(prompts))}
    assert warm.traces == traces, "a capacity warmed up was traced again"


STATE_CASES = [FAMILY_CASES[f] for f in ("recurrent_gemma", "baichuan_m1", "qwen3_next", "qwen3_5_moe")
               if f in FAMILY_CASES]


@pytest.mark.parametrize("d", STATE_CASES, ids=_ids)
def test_state_rows_step_together_in_micro_batches(d):
    # Recurrent, conv and DeltaNet state live in the batch buffers as slices
    # of [C, ...] arrays (decode.StaticState), so those families' rows step
    # in one forward (micro-batched here: each part updates its rows only);
    # a one-token prompt starts from a zero state in a slot another row held
    model = load_model(d).model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.args.vocab_size, k) for k in (4, 9, 1, 6)]
    params = [SamplingParams(), SamplingParams(temp=0.9, top_k=20, seed=7), SamplingParams(), SamplingParams()]
    got, eng = _run_batched(model, prompts, params, 6, joins=[0, 0, 3, 3], micro=2)
    assert eng.static and eng.stateful and eng.traces < 12
    assert [got[i] for i in range(4)] == [alone_ids(model, p, 6, s)
                                          for p, s in zip(prompts, params)]


@pytest.mark.parametrize("d", [default_model_dir()] + [FAMILY_CASES[f] for f in ("gemma2", "gemma4", "llama")
                                                       if f in FAMILY_CASES], ids=_ids)
def test_prompt_cache_reuses_a_prefix_and_changes_nothing(d):
    # Multi-turn chat resends the conversation: the second request's prompt
    # starts with the first's prompt and reply; it reuses their keys/values
    # (sliding layers included: prompts past the window) and gives the tokens
    # it gives alone (DeltaNet state: tests/test_qwen3_next.py).
    from mlxcel_dist.engine.prompt_cache import PromptCache

    model = load_model(d).model
    V = model.args.vocab_size
    rng = np.random.default_rng(2)
    first = rng.integers(3, V, 45)
    pc = PromptCache()
    eng = BatchEngine(model, prompt_cache=pc)
    eng.add("a", first)
    reply = [eng.step()["a"] for _ in range(6)]
    eng.remove("a")  # kept: first + reply (the tokens fed; the last by the step in flight)
    second = np.concatenate([first, reply, rng.integers(3, V, 9)])
    eng.add("b", second)
    got = [eng.step()["b"] for _ in range(8)]
    eng.remove("b")
    assert pc.hits == 1 and pc.misses == 1
    assert got == alone_ids(model, second, 8)
    # the same prompt again: everything but its last token comes from the cache
    eng.add("c", second)
    assert [eng.step()["c"] for _ in range(8)] == got and pc.hits == 2


def test_prompt_cache_evicts_least_recently_used_within_its_bytes():
    from mlxcel_dist.engine.prompt_cache import PromptCache

    model = load_model(default_model_dir()).model
    probe = PromptCache()
    probe.store([5] * 10, _prefilled(model, [5] * 10))
    per_entry = probe.nbytes
    pc = PromptCache(max_entries=10, max_bytes=2 * per_entry)
    for t in (5, 6, 7):
        pc.store([t] * 10, _prefilled(model, [t] * 10))
    assert list(pc.entries) == [(6,) * 10, (7,) * 10] and pc.nbytes == 2 * per_entry
    k, cache = pc.lookup([6] * 10 + [1], model.make_cache)  # 6 becomes the most recent
    assert k == 10 and cache[0].offset == 10
    pc.store([8] * 10, _prefilled(model, [8] * 10))
    assert list(pc.entries) == [(6,) * 10, (8,) * 10]
    assert pc.lookup([7] * 11, model.make_cache) == (0, None)
    small = PromptCache(max_entries=1)
    small.store([1, 2], _prefilled(model, [1, 2]))
    small.store([3, 4], _prefilled(model, [3, 4]))
    assert list(small.entries) == [(3, 4)]


PIPELINE_CASES = [default_model_dir()] + [FAMILY_CASES[f] for f in ("gemma2", "qwen3", "gpt_oss")
                                           if f in FAMILY_CASES]


@pytest.mark.parametrize("d", PIPELINE_CASES, ids=_ids)
def test_pipelined_steps_are_the_unpipelined_ones(d):
    # Rows finish while the next step is in flight (each leaves after its own
    # count, one as soon as it reads its first id) and a row joins beside the
    # step in flight: every row's ids are those of unpipelined steps and of
    # the request alone (seeded sampling, repetition penalty included), and
    # a removed row's unread step never shows (no id, context or count).
    model = load_model(d).model
    V = model.args.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, V, k) for k in (30, 6, 21, 1)]
    params = [SamplingParams(temp=0.8, seed=11), SamplingParams(repetition_penalty=1.4, repetition_context_size=5),
              SamplingParams(), SamplingParams(temp=1.2, top_k=9, seed=5, repetition_penalty=1.2)]
    lengths, joins = [12, 1, 7, 9], [0, 0, 0, 4]
    alone = [alone_ids(model, p, n, s) for p, s, n in zip(prompts, params, lengths)]
    for pipelined in (True, False):
        eng = BatchEngine(model, pipelined=pipelined)
        got, rows, step = {i: [] for i in range(4)}, {}, 0
        while step <= max(joins) or len(eng):
            for i, at in enumerate(joins):
                if at == step:
                    eng.add(i, prompts[i], params[i])
                    rows[i] = eng.rows[-1]
            for rid, tok in eng.step().items():
                got[rid].append(tok)
                if len(got[rid]) == lengths[rid]:
                    eng.remove(rid)
            step += 1
        assert [got[i] for i in range(4)] == alone, pipelined
        for i, r in rows.items():  # the extra step fed the last id; its own id was dropped
            assert r.generated == alone[i] and r.context == list(prompts[i]) + alone[i]
            assert r.pos == len(prompts[i]) - 1 + lengths[i] + pipelined


@pytest.mark.parametrize("d", PIPELINE_CASES, ids=_ids)
def test_all_greedy_rows_take_one_batched_argmax(d, monkeypatch):
    # Every row greedy with no penalty: one argmax over the batch's logits
    # (no per-row Sampler call), the same ids as each request alone; a row with
    # a penalty joining sends the step back to the per-row samplers.
    import mlxcel_dist.engine.sampling as sampling

    calls = []
    orig = sampling.Sampler.sample
    monkeypatch.setattr(sampling.Sampler, "sample", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    model = load_model(d).model
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, model.args.vocab_size, k) for k in (17, 5, 26)]
    params = [SamplingParams(), SamplingParams(), SamplingParams(repetition_penalty=1.3)]
    n = 8
    alone = [alone_ids(model, p, n, s) for p, s in zip(prompts, params)]
    calls.clear()
    eng = BatchEngine(model)
    got = {i: [] for i in range(3)}
    for i in (0, 1):
        eng.add(i, prompts[i], params[i])
    for _ in range(3):
        for rid, tok in eng.step().items():
            got[rid].append(tok)
    if eng.static:
        assert not calls  # the greedy rows' steps took the batched argmax
    eng.add(2, prompts[2], params[2])
    while len(eng):
        for rid, tok in eng.step().items():
            got[rid].append(tok)
            if len(got[rid]) == n:
                eng.remove(rid)
    assert calls  # with the penalised row: per-row samplers
    assert [got[i] for i in range(3)] == alone


def test_no_step_is_launched_past_every_rows_budget():
    # A row's budget (the server's max_tokens): once every row has its last
    # step launched, `step` reads it without launching one more (a lone
    # request's wasted step would delay the next request's prefill).
    model = load_model(default_model_dir()).model
    rng = np.random.default_rng(6)
    pa, pb = rng.integers(3, model.args.vocab_size, 9), rng.integers(3, model.args.vocab_size, 4)
    eng = BatchEngine(model)
    eng.add_many([("a", pa, None, 5), ("b", pb, None, 3)])
    got = [eng.step() for _ in range(5)]
    a, b = eng.rows
    assert [s["a"] for s in got] == alone_ids(model, pa, 5)
    assert a.launched == 5 and b.launched == 5  # "b" past its budget rides along with "a"
    assert not eng.in_flight


@pytest.mark.parametrize("d", PIPELINE_CASES, ids=_ids)
def test_a_row_removed_mid_pipeline_keeps_an_exact_entry(d):
    # Row "a" leaves while a step is in flight (its sliding rings have
    # wrapped: the in-flight step wrote over a slot of the ring). Its prompt
    # cache entry is bit for bit the one unpipelined steps keep for the same
    # tokens (there: one more step, whose id is never fed), and the row
    # beside it decodes on unchanged; a later prompt reusing the entry gives
    # the ids it gives alone.
    from mlxcel_dist.engine.prompt_cache import PromptCache

    model = load_model(d).model
    V = model.args.vocab_size
    rng = np.random.default_rng(4)
    pa, pb = rng.integers(3, V, 37), rng.integers(3, V, 12)
    entries, beside = [], []
    for pipelined in (True, False):
        pc = PromptCache()
        eng = BatchEngine(model, prompt_cache=pc, pipelined=pipelined)
        eng.add("a", pa)
        eng.add("b", pb, SamplingParams(temp=0.7, seed=2))
        got = [eng.step() for _ in range(9 if pipelined else 10)]
        reply = [s["a"] for s in got][:9]
        eng.remove("a")
        beside.append([s["b"] for s in got] + [eng.step()["b"] for _ in range(5 if pipelined else 4)])
        key = tuple(int(t) for t in np.concatenate([pa, reply]))
        assert key in pc.entries, pipelined
        entries.append(pc.entries[key][0])
        eng.remove("b")
    assert beside[0] == beside[1]
    for kp, ku in zip(*entries):
        assert (kp is None) == (ku is None)
        if kp is not None:
            for x, y in zip(kp, ku):
                assert x.shape == y.shape and np.array_equal(np.array(x), np.array(y))
    follow = np.concatenate([pa, reply, rng.integers(3, V, 5)])
    pc = PromptCache()
    pc.store_layers(key, entries[0], [c.window for c in model.make_cache()])  # the pipelined entry
    eng = BatchEngine(model, prompt_cache=pc)
    eng.add("c", follow)
    assert pc.hits == 1 and [eng.step()["c"] for _ in range(6)] == alone_ids(model, follow, 6)


@pytest.mark.parametrize("d", CASES, ids=_ids)
def test_prompts_prefilled_together_decode_as_they_would_alone(d, monkeypatch):
    # One add_many: prompts past the sliding window beside short ones (rows
    # finish their prefill at different chunks), a one-token prompt, and a
    # prompt-cache hit (its prefix past the window) beside misses; greedy and
    # seeded sampling. Each request's ids are its ids alone.
    import mlxcel_dist.engine.batch as batch
    from mlxcel_dist.engine.prompt_cache import PromptCache

    model = load_model(d).model
    V = model.args.vocab_size
    rng = np.random.default_rng(5)
    kept = rng.integers(3, V, 30)
    prompts = [rng.integers(3, V, k) for k in (70, 3, 1, 40, 17)]
    prompts.append(np.concatenate([kept, rng.integers(3, V, 6)]))
    params = [SamplingParams(), SamplingParams(temp=0.9, top_k=20, seed=7), SamplingParams(),
              SamplingParams(repetition_penalty=1.3), SamplingParams(temp=1.1, top_p=0.9, seed=3), SamplingParams()]
    n, step = 8, 16
    alone = [alone_ids(model, p, n, s, prefill_step=step) for p, s in zip(prompts, params)]
    together = []
    monkeypatch.setattr(prefill, "PAD_SLACK", 100.0)  # one group however uneven: padding tested too
    monkeypatch.setattr(Together, "__init__",
                        lambda self, engine, admits, L, f=Together.__init__: together.append(len(admits))
                        or f(self, engine, admits, L))
    pc = PromptCache()
    eng = BatchEngine(model, prefill_step=step, prompt_cache=pc)
    eng.add("kept", kept)  # keeps kept[:-1]: a prefix of the last prompt
    eng.remove("kept")
    eng.add_many([(i, p, s) for i, (p, s) in enumerate(zip(prompts, params))])
    got = {i: [] for i in range(len(prompts))}
    for _ in range(n):
        for rid, tok in eng.step().items():
            got[rid].append(tok)
    assert [got[i] for i in range(len(prompts))] == alone
    if eng.static and not eng.stateful:  # (a state would take in the pads: prefilled alone)
        assert together == [5] and pc.hits == 1  # all but the one-token prompt, together
        # the longest prompt's entry, kept by the prefill together, reused alone
        more = np.concatenate([prompts[0], rng.integers(3, V, 4)])
        eng.add("more", more)
        reply = []
        while len(reply) < 4:  # the rows beside it: a step already in flight without it
            reply += [tok for rid, tok in eng.step().items() if rid == "more"]
        assert pc.hits == 2 and reply == alone_ids(model, more, 4)
    else:
        assert together == [] and pc.hits == PromptCache.cacheable(model.make_cache())  # (a state's: DeltaNet, RG-LRU)


def test_prompts_group_while_their_padding_stays_small():
    # Prompts prefill together while padding each chunk to its longest row
    # costs at most PAD_SLACK x their tokens; a group of one goes alone.
    from mlxcel_dist.engine.prefill import Admission, pad_groups

    def admits(*left):
        return [Admission(i, None, n, None, 0, None) for i, n in enumerate(left)]

    sizes = lambda groups: [[a.last for a in g] for g in groups]  # noqa: E731
    assert sizes(pad_groups(admits(300, 250, 200, 180, 150, 120, 100, 64), 2048)) == \
        [[300, 250, 200], [180, 150, 120], [100, 64]]
    assert sizes(pad_groups(admits(20, 20, 20, 3), 2048)) == [[20, 20, 20], [3]]
    # chunks of 16: the long prompts' unpadded chunks amortise a short one's padding
    assert sizes(pad_groups(admits(5, 70, 60), 16)) == [[70, 60, 5]]
    assert sizes(pad_groups(admits(5, 70), 2048)) == [[70], [5]]


def _prefilled(model, tokens):
    import mlx.core as mx

    cache = model.make_cache()
    model(mx.array(tokens)[None], cache)
    return cache


@pytest.mark.parametrize("d", [d for d in cases("llama4") if "fp32" in d.name][:1], ids=_ids)
def test_chunked_attention_rows_give_the_single_row_logits(d, monkeypatch):
    # llama4 (chunk 8): prompts prefilled together in chunks of 6 (not aligned
    # to the attention chunk; the shorter ones padded), a later one alone,
    # then rows decoding at their own positions across chunk boundaries (the
    # 8-slot buffers are rings of the chunk): every row's logits at every
    # step are the one-pass logits of its sequence alone.
    import mlxcel_dist.engine.batch_step as batch_step
    from mlxcel_dist.engine.generation import sequence_logits
    from mlxcel_dist.harness import FP32_REL_TOL, compare

    model = load_model(d).model
    chunk = model.args.attention_chunk_size
    V = model.args.vocab_size
    rng = np.random.default_rng(11)
    prompts = {i: rng.integers(3, V, n) for i, n in enumerate((21, 5, 13, 30, 2))}
    late = rng.integers(3, V, 11)
    together = []
    monkeypatch.setattr(prefill, "PAD_SLACK", 100.0)
    monkeypatch.setattr(Together, "__init__",
                        lambda self, engine, admits, L, f=Together.__init__: together.append(len(admits))
                        or f(self, engine, admits, L))
    eng = BatchEngine(model, prefill_step=6)
    seen = {}
    extras = batch_step.logprobs

    def grab(choices, logits, ids, pending=None, masks=None):  # each row's logits of the step, the position it fed
        for c, x in zip(choices, logits):
            seen.setdefault(c.row.rid, []).append((c.row.pos, x))
        return extras(choices, logits, ids, pending, masks)

    monkeypatch.setattr(batch_step, "logprobs", grab)
    eng.add_many([(i, p, None) for i, p in prompts.items()])
    got = {i: [] for i in [*prompts, "late"]}
    for step in range(14):
        if step == 3:
            eng.add("late", late)
        for rid, tok in eng.step().items():
            got[rid].append(tok)
    assert eng.static and together == [len(prompts)]  # the first five, prefilled together
    for rid, prompt in {**prompts, "late": late}.items():
        seq = np.concatenate([prompt, got[rid]]).astype(np.int32)
        want = sequence_logits(model, seq)
        rows = [(p, np.array(x.astype(mx.float32))) for p, x in seen[rid] if p < len(seq)]
        assert len({p // chunk for p, _ in rows}) >= 2, rid  # its steps cross a chunk boundary
        r = compare(np.stack([x for _, x in rows]), want[[p for p, _ in rows]], FP32_REL_TOL)
        assert r["ok"], (rid, r)


@pytest.mark.parametrize("d", [default_model_dir(), FAMILY_CASES["recurrent_gemma"]], ids=_ids)
def test_copies_of_a_prompt_share_one_prefill(d):
    # serve's n > 1: the same prompt several times in one add_many (beside
    # another) is prefilled once; each copy decodes as it would alone with its
    # own sampler, also while a step is in flight for an older row.
    model = load_model(d).model
    V = model.args.vocab_size
    rng = np.random.default_rng(11)
    prompt, other, old = rng.integers(3, V, 21), rng.integers(3, V, 9), rng.integers(3, V, 5)
    params = [SamplingParams(temp=0.9, top_k=20, seed=s) for s in (4, 5, 6)] + [SamplingParams()]
    n = 6
    alone = [alone_ids(model, p, n, s)
             for p, s in zip([prompt] * 3 + [other], params)]
    eng = BatchEngine(model)
    eng.add("old", old)
    eng.step()
    before = eng.prefilled
    eng.add_many([(i, p, s) for i, (p, s) in enumerate(zip([prompt] * 3 + [other], params))])
    copies_prefilled = eng.prefilled - before
    got = {i: [] for i in range(4)}
    while any(len(v) < n for v in got.values()):
        for rid, tok in eng.step().items():
            if rid in got and len(got[rid]) < n:
                got[rid].append(tok)
    assert [got[i] for i in range(4)] == alone
    assert len({tuple(v) for v in alone[:3]}) > 1  # the seeds differ: so do the copies
    if eng.static:
        assert copies_prefilled == (len(prompt) - 1) + (len(other) - 1)  # the shared prompt once
    else:  # rows that step eagerly own their caches: each copy prefilled
        assert copies_prefilled == 3 * (len(prompt) - 1) + (len(other) - 1)
