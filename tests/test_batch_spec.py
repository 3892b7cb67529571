"""Drafts in the batch engine's steps (batch_spec.py) when lookups miss and
as acceptance moves: a step where no row drafts is the engine's plain
pipelined step (counted: `BatchDrafts.steps` and the verify forwards,
`BatchEngine.feed`, seen from outside), rows that draft and rows that do not
share the verify steps, and each row's k adapts to what it accepts; the ids
always those of plain greedy decoding."""

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.engine.batch import BatchEngine
from mlxcel_dist.engine.batch_spec import POSITION_COST as POSITION, BatchDrafts, DraftRows
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.engine.sampling import SamplingParams

from test_serve_spec import perturbed, run

K = 3
GREEDY = SamplingParams(temp=0.0)
# prompts for the embedded tiny model whose first 20 greedy ids repeat no id of prompt or output
# (prompt lookup finds nothing), and one it continues by repeating itself (254, 254, 94, 94, ...)
NO_REPEATS = [[293, 449, 184, 39, 132, 271, 344, 473], [444, 220, 117, 329, 492, 289, 176, 74]]
LOOPS = [5, 100, 200, 300, 7, 9]
N = 20


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_dir()).model


def counted(engine) -> list:
    """The block lengths L of every verify forward `engine` runs (its `feed` calls)."""
    widths, feed = [], engine.feed

    def spy(tokens: mx.array, pos: list):
        widths.append(tokens.shape[1])
        return feed(tokens, pos)

    engine.feed = spy
    return widths


def test_lookup_misses_take_the_plain_pipelined_step(model):
    reqs = [(i, p, GREEDY) for i, p in enumerate(NO_REPEATS)]
    want = run(BatchEngine(model), reqs, N)
    spec = BatchDrafts(K)
    engine = BatchEngine(model, spec=spec)
    widths = counted(engine)
    lengths = []
    assert run(engine, reqs, N, lengths) == want
    assert widths == [] and spec.steps == {"plain": len(lengths), "verify": 0, "reread": 0}
    assert spec.total == [0, 0, 0] and all(set(s.values()) == {1} for s in lengths)


def test_hits_draft_beside_rows_that_miss(model):
    # a looping row accepts drafts; the rows without a hit take one id a step in the same steps,
    # the first with logprobs (never drafts; one id and its logprobs a step)
    reqs = [(0, NO_REPEATS[0], GREEDY), (1, LOOPS, GREEDY), (2, NO_REPEATS[1], GREEDY)]
    plain = BatchEngine(model)
    plain.want[0] = 2
    want = run(plain, reqs, 2 * N)
    spec = BatchDrafts(K)
    engine = BatchEngine(model, spec=spec)
    engine.want[0] = 2
    widths = counted(engine)
    lengths, lps = [], []
    step = engine.step

    def logged():
        out = step()
        lps.append(len(engine.logprobs.get(0, ())) if 0 in out else None)
        return out

    engine.step = logged
    assert run(engine, reqs, 2 * N, lengths) == want
    drafts, drafted, accepted = spec.total
    assert 0 < accepted <= drafted and spec.steps["verify"] == len(widths) > 0
    assert spec.steps["plain"] > 0  # before the loop starts, no row has a hit
    assert any(s.get(1, 1) > 1 and s.get(2, 1) == 1 for s in lengths)  # 1 and several ids in one step
    assert all(s.get(0, 1) == 1 for s in lengths) and all(n in (None, 2) for n in lps)
    assert all(2 <= L <= K + 1 for L in widths)


def test_k_adapts_to_acceptance_and_ids_stay(model):
    # a draft model that agrees in part: rows accept different lengths, so their k moves
    prompts = [[2, 40, 41, 42, 43], NO_REPEATS[0], LOOPS]
    reqs = [(i, p, GREEDY) for i, p in enumerate(prompts)]
    want = run(BatchEngine(model), reqs, N)

    def drafted(adaptive: bool):
        draft = DraftRows(perturbed(load_model(default_model_dir()).model, 0.3), K)
        spec = BatchDrafts(K, draft, adaptive=adaptive, cost=(1.0, 0.2))  # cheap drafts (a few-layer
        # draft's); with this draft the CPU's cost keeps k low
        engine = BatchEngine(model, spec=spec)
        widths, seen = counted(engine), []
        step = engine.step

        def logged():
            seen.append(dict(spec.row_k))
            return step()

        engine.step = logged
        return run(engine, reqs, N), spec, widths, seen

    got, spec, widths, seen = drafted(True)
    assert got == want
    ks = [k for s in seen for k in s.values()]
    assert ks and min(ks) < K and all(1 <= k <= K for k in ks)  # lowered on rejections, never outside [1, K]
    assert any(a < b for s, t in zip(seen, seen[1:]) for rid, a in s.items() if (b := t.get(rid)))  # raised
    fixed, spec0, widths0, _ = drafted(False)
    assert fixed == want and spec0.row_k == {} and max(widths0) == K + 1
    # the same ids from fewer drafts and narrower verify forwards
    assert spec.total[1] < spec0.total[1] and sum(widths) < sum(widths0)


def test_a_draft_row_feeds_only_the_ids_its_cache_lacks(model):
    # a round that rejected a draft leaves the draft model's cache holding every agreed id but the
    # last (the target's own): the next round feeds that one id (a lone row: the split one-row
    # step); after a round that took all its drafts the last draft was never fed: two ids; a new
    # row two. The ids stay plain greedy's
    reqs = [(0, NO_REPEATS[0], GREEDY)]
    want = run(BatchEngine(model), reqs, N)
    draft = DraftRows(perturbed(load_model(default_model_dir()).model, 0.3), K)
    spec = BatchDrafts(K, draft, adaptive=False)
    engine = BatchEngine(model, spec=spec)
    rounds, draft_of, feed = [], draft.draft, draft.engine.feed  # per round: [its first feed's width, full]

    def drafting(rows, k):
        rounds.append([None, None])
        return draft_of(rows, k)

    def feeding(tokens, pos):
        if rounds[-1][0] is None:
            rounds[-1][0] = tokens.shape[1]
        return feed(tokens, pos)

    step = engine.step

    def stepping():
        n = len(rounds)
        out = step()
        if len(rounds) > n:
            rounds[-1][1] = spec.last[1] == spec.last[2]  # every draft accepted
        return out

    draft.draft, draft.engine.feed, engine.step = drafting, feeding, stepping
    assert run(engine, reqs, N) == want
    assert rounds[0][0] == 2
    assert [w for w, _ in rounds[1:]] == [2 if full else 1 for _, full in rounds[:-1]], rounds
    assert {w for w, _ in rounds[1:]} == {1, 2}, rounds  # both kinds of round seen


def test_draft_model_rows_that_do_not_pay_rest_and_catch_up(model):
    # a draft that agrees little, at a cost where a round of k drafts must yield 0.8 (1 + 0.5 k)
    # ids: its rows rest (plain pipelined steps while all rest), come back, and feed the draft the
    # ids of the plain steps since (blocks of K + 1): every draft the draft model's own greedy id
    # on the context as read, the ids plain greedy's
    rng = np.random.default_rng(1)
    reqs = [(i, rng.integers(3, 512, 8).tolist(), GREEDY) for i in range(2)]
    want = run(BatchEngine(model), reqs, 3 * N)
    dmodel = perturbed(load_model(default_model_dir()).model, 1.0)
    draft = DraftRows(dmodel, K)
    spec = BatchDrafts(K, draft, cost=(1.0, 0.5))
    engine = BatchEngine(model, spec=spec)
    rounds, widths, draft_of, feed = [], [], draft.draft, draft.engine.feed

    def drafting(rows, k):
        d, q = draft_of(rows, k)
        rounds.append(([list(r.context) for r in rows], np.array(d).tolist()))
        return d, q

    def feeding(tokens, pos):
        widths.append(tokens.shape[1])
        return feed(tokens, pos)

    resting, step = [], engine.step

    def stepping():
        resting.append(len(spec.rest))
        return step()

    draft.draft, draft.engine.feed, engine.step = drafting, feeding, stepping
    assert run(engine, reqs, 3 * N) == want
    assert spec.steps["plain"] > 0 and max(resting) == 2 and max(widths) == K + 1  # both rested, caught up
    for ctxs, drafts in rounds:
        for c, d in zip(ctxs, drafts):
            seq = c + d[:-1]
            assert mx.argmax(dmodel(mx.array([seq]))[0, len(c) - 1:], axis=-1).tolist() == d


def test_a_catch_up_longer_than_a_sliding_window(monkeypatch):
    # gemma3's windows of 16 (rings of 16 + K slots): a draft row that lagged more than a window
    # through plain steps catches up in blocks of K + 1 through its rings; the ids plain greedy's
    from reference_cases import FIXTURES

    import mlxcel_dist.engine.batch_spec as batch_spec

    d = FIXTURES / "gemma3" / "gqa_fp32"
    model = load_model(d).model
    ids = np.load(d / "reference.npz")["ids"].tolist()
    reqs = [(0, ids[:3], GREEDY), (1, ids[:19], GREEDY), (3, ids[5:12], GREEDY)]
    want = run(BatchEngine(model), reqs, 60)
    lacked, lacks = [], batch_spec.DraftRows._lacks

    def counting(*args):
        lacked.append(lacks(*args))
        return lacked[-1]

    monkeypatch.setattr(batch_spec.DraftRows, "_lacks", counting)
    dmodel = perturbed(load_model(d).model, 1.5)
    draft = DraftRows(dmodel, K)
    rounds, draft_of = [], draft.draft

    def drafting(rows, k):
        out = draft_of(rows, k)
        rounds.append(([list(r.context) for r in rows], np.array(out[0]).tolist()))
        return out

    draft.draft = drafting
    spec = BatchDrafts(K, draft, cost=(1.0, 0.5))
    assert run(BatchEngine(model, spec=spec), reqs, 60) == want
    assert max(lacked) > 16 + K and spec.total[2] > 0  # more ids than a ring holds; drafts were taken
    for ctxs, drafts in rounds:  # (the ids alone would not show a wrong draft: the verify keeps them)
        for c, dr in zip(ctxs, drafts):
            assert mx.argmax(dmodel(mx.array([c + dr[:-1]]))[0, len(c) - 1:], axis=-1).tolist() == dr


def test_lookup_rows_whose_drafts_fail_rest(model):
    # random prompts: the tiny model's output repeats ids here and there, so lookups hit and often miss;
    # rows whose single drafts fail rest (plain steps when all rest or miss), the ids unchanged
    rng = np.random.default_rng(1)
    reqs = [(i, rng.integers(3, 512, 8).tolist(), GREEDY) for i in range(8)]
    want = run(BatchEngine(model), reqs, 48)
    runs = {}
    for adaptive in (True, False):
        spec = BatchDrafts(K, adaptive=adaptive)
        engine = BatchEngine(model, spec=spec)
        resting, step = [], engine.step

        def logged():
            resting.append(sum(until > spec._t + 1 for until, _ in spec.rest.values()))
            return step()

        engine.step = logged
        assert run(engine, reqs, 48) == want
        runs[adaptive] = spec, max(resting)
    (spec, resting), (fixed, none) = runs[True], runs[False]
    assert resting > 0 and none == 0 and fixed.rest == {}
    assert spec.steps["plain"] > fixed.steps["plain"] and spec.total[1] < fixed.total[1]


def test_adapt_rule():
    spec = BatchDrafts(4)
    steps = [(4, 4), (4, 0), (1, 1), (2, 2), (3, 1), (2, 2), (3, 3), (4, 4)]
    got = []
    for k, a in steps:
        spec._adapt("r", k, a)
        got.append(spec.row_k["r"])
    assert got == [4, 1, 2, 3, 2, 3, 4, 4] and spec.rest == {}
    # a lookup row at k 1 whose draft fails rests 1, 2, 4 .. 16 steps; an accepted draft ends that
    spec._adapt("r", 4, 0)
    rests = []
    for t in range(7):
        spec._t = t
        spec._adapt("r", 1, 0)
        until, n = spec.rest["r"]
        rests.append(n)
        assert until == t + n + 1
    assert rests == [1, 2, 4, 8, 16, 16, 16]
    spec._adapt("r", 1, 1)
    assert "r" not in spec.rest and spec.row_k["r"] == 2
    # a draft-model row never rests (its draft rows must stay at most two ids behind)
    spec = BatchDrafts(4, DraftRows.__new__(DraftRows))
    spec.cost = (1.0, 0.2)
    for _ in range(3):
        spec._adapt("r", 1, 0)
    assert spec.rest == {} and 1 <= spec.row_k["r"] <= 4


def _worth_after(cost: float, rounds: list, k: int = 4, fixed: float = 1.0) -> list:
    """A draft-model row's k after each (drafted, accepted) round, a round costing `fixed` + k x `cost`."""
    spec = BatchDrafts(k, DraftRows.__new__(DraftRows))
    spec.cost = fixed, cost
    got = []
    for d, a in rounds:
        spec._adapt("r", d, a)
        got.append(spec.row_k["r"])
    return got


def test_a_draft_model_rows_k_is_the_most_ids_per_cost():
    # its acceptance by position (EMAs from 0.7, weight 0.2) against a round's V + k x cost steps
    taken = _worth_after(0.2, [(4, 4)] * 6)  # all taken, drafts cheap: up to K as the rates rise
    assert taken[-1] == 4 and all(a <= b for a, b in zip(taken, taken[1:]))
    assert _worth_after(0.0, [(4, 0)] * 6) == [4] * 6  # free drafts: K whatever is taken
    refused = _worth_after(0.2, [(4, 0)] * 8)  # every first draft refused: down to 1, one step at a time
    assert refused[-1] == 1 and all(a >= b for a, b in zip(refused, refused[1:]))
    # a CPU-like cost (a draft as dear as the target): one draft once the second is refused; all taken,
    # one more next round (positions past k are never seen otherwise)
    assert _worth_after(1.35, [(2, 1)] * 4) == [1] * 4 and _worth_after(1.35, [(1, 1)] * 2) == [2, 2]
    # the same acceptance (the second draft refused every other round), a dearer draft: fewer drafts
    mixed = [(4, 4), (4, 1)] * 6
    assert _worth_after(0.1, mixed)[-1] == 4 and _worth_after(0.6, mixed)[-1] == 1
    # p = 0.8 at every position, cost 0.1: E(k) / (1 + 0.1 k) for k = 1..4 is 1.64, 2.03, 2.26, 2.40
    spec = BatchDrafts(4, DraftRows.__new__(DraftRows))
    spec.cost, spec.rates["r"] = (1.0, 0.1), [0.8] * 4
    assert spec._worth("r", 0, 0) == 4
    spec.cost = 1.0, 0.5  # 1.20, 1.22, 1.18, 1.12: two
    assert spec._worth("r", 0, 0) == 2
    spec.cost = 1.0, 0.3  # E(k) / (1 + 0.3 k): 1.38, 1.53, 1.55, 1.53: three
    assert spec._worth("r", 0, 0) == 3
    spec.cost = 2.0, 0.3  # a verify whose fixed part is two steps: 0.78, 0.94, 1.02, 1.05: all four
    assert spec._worth("r", 0, 0) == 4
    # the same acceptance (the second draft refused every other round): a verify of two steps' fixed
    # cost takes more drafts than one of one step's
    assert _worth_after(0.3, mixed, fixed=2.0)[-1] > _worth_after(0.3, mixed, fixed=1.0)[-1]


def test_a_rounds_cost_comes_from_the_device_the_models_and_the_rows(monkeypatch):
    # the verify's fixed part is two steps only for a lone row whose plain steps run split on a GPU
    # (every layer full: llama), one elsewhere; a draft position costs the draft's share of the layers
    from reference_cases import FIXTURES

    import mlxcel_dist.engine.batch_spec as batch_spec

    target = load_model(FIXTURES / "llama" / "gqa_fp32").model
    spec = BatchDrafts(K, DraftRows(load_model(FIXTURES / "llama" / "gqa_fp32").model, K))
    engine = BatchEngine(target, spec=spec)
    engine.add_many([(0, [2, 5, 7, 9], GREEDY)])
    engine.step()
    share = 1.0  # (the same layers: (d + 1) / (t + 1))
    assert spec.cost == spec._cost(engine) == (1.0, POSITION["cpu"] + share)
    gpu = type("Device", (), {"type": mx.DeviceType.gpu})()

    def on_a_gpu():
        with monkeypatch.context() as m:  # (only around the reading: the steps run on this machine)
            m.setattr(batch_spec.mx, "default_device", lambda: gpu)
            return spec._cost(engine)

    assert engine.steps.splits(1) and on_a_gpu() == (batch_spec.SPLIT_VERIFY, POSITION["gpu"] + share)
    engine.add_many([(1, [2, 6, 8], GREEDY)])
    engine.step()
    assert on_a_gpu() == (1.0, POSITION["gpu"] + share)  # two rows: the masked graph either way


def test_ngram_index_drafts_what_prompt_lookup_drafts():
    from mlxcel_dist.engine.batch_spec import _Ngrams
    from mlxcel_dist.engine.spec import PromptLookup

    rng = np.random.default_rng(0)
    for _ in range(200):  # small vocabularies: many repeats; contexts grown by 1-3 ids a step
        vocab, k = int(rng.integers(2, 20)), int(rng.integers(1, 6))
        hi, lo = sorted(rng.integers(1, 5, 2).tolist(), reverse=True)
        plain = PromptLookup(k, hi, lo)
        index, ctx = _Ngrams(plain), rng.integers(0, vocab, int(rng.integers(1, 5))).tolist()
        for _ in range(30):
            assert index.lookup(ctx) == plain.lookup(ctx), (ctx, hi, lo, k)
            ctx += rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
