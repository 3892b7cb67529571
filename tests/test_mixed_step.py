"""The mixed step (prefill.py): prompts admitted while rows decode are
prefilled a token budget a step beside them. Every running row still gets
its id each step, and every request's ids are the ids it gets alone: for
a family of every cache kind (full, sliding ring, chunked, latent,
recurrent, conv, DeltaNet, shared KV; quantized in its own test), with drafts and
grammar rows in the batch. The launched forms (np 2, pp 2) are in
tests/test_serve_pp.py."""

import re

import numpy as np
import pytest

from mlxcel_dist.engine.batch import BatchEngine
from mlxcel_dist.cache import KVOptions
from mlxcel_dist.engine.generation import Generation
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.engine.prefill import Budget
from mlxcel_dist.engine.sampling import SamplingParams

from test_batch import FAMILY_CASES, _ids, small_buffers  # noqa: F401 (the fixture: 8-slot buffers, as there)

# One family per cache kind (test_batch runs every family's rows; the prefill jobs are per kind):
# full + sliding ring (the default gemma3), chunked (llama4), latent (deepseek_v3), recurrent
# (recurrent_gemma), conv over K/V (baichuan_m1), DeltaNet (qwen3_next), a layer reading another's KV (gemma4)
KINDS = ["llama4", "deepseek_v3", "recurrent_gemma", "baichuan_m1", "qwen3_next", "gemma4"]
CASES = [default_model_dir()] + [FAMILY_CASES[f] for f in KINDS]

GREEDY = SamplingParams()


def alone(model, prompt, n, sampling=GREEDY):
    return list(Generation(model, np.asarray(prompt), n, sampling, eos_ids=()))


def drive(eng, early, late, n, at=2):
    """`early` requests (rid, ids, sampling) admitted first, `late` ones at step
    `at`; each row leaves after n ids. Returns ({rid: ids}, the steps from the
    late admission until every late row had its first id, and whether each of
    those steps gave every early row still running an id)."""
    eng.add_many([(rid, p, s, n) for rid, p, s in early])
    got = {rid: [] for rid, *_ in early + late}
    step, admitting, steps, fed = 0, False, 0, True
    while len(eng) or eng.prefilling or step <= at:
        if step == at:
            eng.add_many([(rid, p, s, n) for rid, p, s in late])
            admitting = True
        out = eng.step()
        step += 1
        if admitting:
            steps += 1
            running = [rid for rid, *_ in early if rid in eng and len(got[rid]) < n]
            fed = fed and all(rid in out for rid in running)
        for rid, t in out.items():
            got[rid] += t if isinstance(t, list) else [t]
            if len(got[rid]) >= n:
                eng.remove(rid)
        if admitting and all(got[rid] for rid, *_ in late):
            admitting = False
    return {rid: ids[:n] for rid, ids in got.items()}, steps, fed


def _requests(V, seed=3):
    rng = np.random.default_rng(seed)
    early = [(0, rng.integers(3, V, 5), GREEDY), (1, rng.integers(3, V, 9), SamplingParams(temp=0.9, seed=5)),
             (2, rng.integers(3, V, 2), SamplingParams(repetition_penalty=1.2))]
    late = [(10, rng.integers(3, V, 45), GREEDY), (11, rng.integers(3, V, 33), SamplingParams(temp=1.0, seed=9)),
            (12, rng.integers(3, V, 1), GREEDY)]
    return early, late


@pytest.mark.parametrize("d", CASES, ids=_ids)
def test_long_prompts_admitted_while_rows_decode_give_the_ids_alone(d):
    # a budget of 8 tokens a step: two long prompts (prefilled together where the
    # caches allow, else one by one) take several steps, every early row gets
    # its id at each of them, and every request's ids are its ids alone
    model = load_model(d).model
    early, late = _requests(model.args.vocab_size)
    n = 12
    want = {rid: alone(model, p, n, s) for rid, p, s in early + late}
    eng = BatchEngine(model, prefill_step=16, budget=Budget(8))
    got, steps, fed = drive(eng, early, late, n)
    assert got == want
    assert fed, "a running row went without its id while prompts were prefilled"
    assert steps >= 5, steps  # 77 prompt tokens at most 8 (or 2 a row, when 3 decode) a step


def test_quantized_rows_mixed_with_a_chunked_admission():
    model = load_model(default_model_dir(), kv=KVOptions(bits=8, group_size=32)).model
    early, late = _requests(model.args.vocab_size, seed=4)
    want = {rid: alone(model, p, 10, s) for rid, p, s in early + late}
    got, steps, fed = drive(BatchEngine(model, prefill_step=16, budget=Budget(8)), early, late, 10)
    assert got == want and fed and steps >= 5


def test_budget_leaves_no_prompt_behind_many_rows():
    # more decoding rows than the budget: prompts still move (a quarter of the budget a step)
    model = load_model(default_model_dir()).model
    rng = np.random.default_rng(0)
    V = model.args.vocab_size
    early = [(i, rng.integers(3, V, 3), GREEDY) for i in range(10)]
    late = [(99, rng.integers(3, V, 40), GREEDY)]
    eng = BatchEngine(model, budget=Budget(8))
    got, steps, fed = drive(eng, early, late, 30)
    assert got[99] == alone(model, late[0][1], 30) and fed
    assert steps <= 40 // 2 + 2  # 2 tokens a step (8 // 4) at the least


def test_drafts_and_grammar_rows_beside_a_chunked_admission():
    pytest.importorskip("llguidance")
    from mlxcel_dist.engine import grammar
    from mlxcel_dist.engine.batch_spec import BatchDrafts
    from mlxcel_dist.checkpoint.loader import read_config
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    d = default_model_dir()
    model = load_model(d).model
    tok = Tokenizer(d, read_config(d))
    vocab = grammar.Vocab(d / "tokenizer.json", model.args.vocab_size, tok.eos_ids)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    g = grammar.json_schema(schema)
    story = tok.encode("The sea is calm today. The sky is clear. The sea is calm today. The sky is")
    long = tok.encode("A city by the sea. " * 12)
    n = 16
    eng = BatchEngine(model, vocab=vocab, spec=BatchDrafts(3), budget=Budget(8))
    eng.add_many([(0, story, GREEDY, n), (1, tok.encode("Numbers:"), GREEDY, n, g)])
    got = {0: [], 1: [], 2: []}
    step = 0
    while len(eng) or eng.prefilling or step < 2:
        if step == 1:
            eng.add_many([(2, long, GREEDY, n)])
        step += 1
        for rid, t in eng.step().items():
            got[rid] += t if isinstance(t, list) else [t]
            if len(got[rid]) >= n or got[rid][-1] in tok.eos_ids:
                eng.remove(rid)
    assert eng.spec.total[2] > 0  # the story row accepted drafts
    assert got[0][:n] == alone(model, story, n)
    assert got[2][:n] == alone(model, long, n)
    lone = BatchEngine(model, vocab=vocab)  # the constrained row alone
    lone.add_many([(1, tok.encode("Numbers:"), GREEDY, n, g)])
    ids = []
    while len(lone):
        ids.append(lone.step()[1])
        if len(ids) >= n or ids[-1] in tok.eos_ids:
            lone.remove(1)
    assert got[1] == ids


def test_a_request_cancelled_or_failing_in_its_prefill_leaves_the_others_alone(monkeypatch):
    from mlxcel_dist.engine import prefill

    model = load_model(default_model_dir()).model
    rng = np.random.default_rng(1)
    V = model.args.vocab_size
    p = {rid: rng.integers(3, V, k) for rid, k in ((0, 4), (1, 40), (2, 30), (3, 50))}
    eng = BatchEngine(model, budget=Budget(8))
    got = {0: [], 2: []}
    eng.add_many([(0, p[0], GREEDY, 20)])
    got[0].append(eng.step()[0])
    eng.add_many([(1, p[1], GREEDY, 20), (2, p[2], GREEDY, 20), (4, p[2], GREEDY, 20)])  # 4: a copy of 2
    out = eng.step()
    assert list(out) == [0]  # the prompts are still prefilling: row 0 alone has an id
    got[0].append(out[0])
    assert 1 in eng and 4 in eng and eng.prefilling
    eng.remove(1)  # gone mid-prefill (with 2, in one group): 1 never gets a row, 2 and its copy do
    eng.remove(4)
    real, staged = prefill.Alone.run, prefill.Together.stage

    def broken(self, n):
        if self.a.rid == 3:
            raise RuntimeError("no memory")
        return real(self, n)

    def broken_stage(self, n, flat=True):  # (a prompt alone in prefill buffers, its chunks in the rows' step)
        if any(a.rid == 3 for a in self.admits):
            raise RuntimeError("no memory")
        return staged(self, n, flat)

    monkeypatch.setattr(prefill.Alone, "run", broken)
    monkeypatch.setattr(prefill.Together, "stage", broken_stage)
    eng.add_many([(3, p[3], GREEDY, 20)])
    while len(eng) or eng.prefilling:
        for rid, t in eng.step().items():
            assert rid in got
            got[rid].append(t)
            if len(got[rid]) == 20:
                eng.remove(rid)
    assert eng.failed == {3: "RuntimeError: no memory"}
    assert got == {0: alone(model, p[0], 20), 2: alone(model, p[2], 20)}


@pytest.mark.parametrize("message,ends_job", [("[ring] connection to a peer was lost", True),
                                              ("[host channel] rank 1 is gone (reset)", True),
                                              ("[metal] no memory", False)])
def test_a_lost_link_in_a_prefill_ends_the_job_not_the_request(monkeypatch, message, ends_job):
    """A peer gone mid-prefill is the job's failure: it leaves the engine (the
    rank's main prints one line and exits) instead of failing one request as
    a prompt's own error does, which let a rank of generate print a traceback."""
    from mlxcel_dist.engine import prefill

    model = load_model(default_model_dir()).model
    prompt = np.random.default_rng(2).integers(3, model.args.vocab_size, 40)

    def lost(self, n):
        raise RuntimeError(message)

    monkeypatch.setattr(prefill.Alone, "run", lost)
    monkeypatch.setattr(prefill.Together, "run", lost)
    eng = BatchEngine(model)
    if ends_job:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            eng.add_many([(0, prompt, GREEDY, 4)])
    else:
        eng.add_many([(0, prompt, GREEDY, 4)])
        assert eng.failed == {0: f"RuntimeError: {message}"}


def test_budget_rules():
    from mlxcel_dist.engine import prefill

    fixed = Budget(64)
    for rows in range(0, 200):
        got = fixed.prefill(rows)
        assert got >= 16  # a quarter at least: prompts keep moving under any number of rows
        if rows <= 48:
            assert rows + got == 64  # the rows' tokens first, the prompts the rest
    share = Budget()
    assert share.prefill(1) == prefill.MIN_PREFILL
    assert share.prefill(32) == prefill.PREFILL_PER_DECODE * 32


@pytest.mark.parametrize("stall", [3.0, 5.0])
def test_pacer_keeps_a_mixed_step_within_its_stall_bound(stall):
    # decode steps of 100 ms, prompt tokens of 5 ms inside a step: (stall - 1) x 100 / 5 tokens,
    # so a mixed step takes `stall` x the plain one (serve --max-stall)
    from mlxcel_dist.serve import pacing

    p = pacing.Pacer(stall)
    assert p.tokens() == 0  # nothing measured: the engine's own budget
    p.observe(0.1, 4, 0)
    assert p.tokens() == 0
    for _ in range(50):
        n = p.tokens() or 8
        p.observe(0.1 + 0.005 * n, 4, n)
        p.observe(0.1, 4, 0)
    n = p.tokens()
    assert n == int(pacing.HEADROOM * (stall - 1) * 0.1 / 0.005)
    assert 1 + 0.75 * (stall - 1) <= (0.1 + 0.005 * n) / 0.1 <= stall  # below the bound: room for the spread
    p.observe(5.0, 0, 10)  # a prefill alone (no rows): the token's whole cost
    assert p.tokens() >= pacing.MIN_TOKENS


@pytest.mark.parametrize("fixed", [0.05, 0.3])
def test_pacer_tells_a_chunks_fixed_cost_from_its_tokens(fixed):
    # a mixed step costs d + c + n p (c: the chunk's forward whatever its size, as a GPU's
    # host time). c = 0.05 beside d = 0.1 (S = 3): room for chunks, the per-token rule keeps
    # the step within the bound. c = 0.3: even 8 tokens break it, while a long chunk (a prompt
    # alone, 512 tokens) shows a token's own cost is small: chunks of (S - 1) x (d + c) work,
    # few stalls, not one on every step with 8 tokens
    from mlxcel_dist.serve import pacing

    d, p_tok = 0.1, 0.0005
    p = pacing.Pacer(3.0)
    p.observe(d, 4, 0)
    p.observe(fixed + p_tok * 512, 0, 512)  # a prompt alone, one long chunk (no rows)
    steps = []
    for _ in range(60):
        n = p.tokens() or 8
        steps.append((n, d + fixed + p_tok * n))
        p.observe(steps[-1][1], 4, n)
    n, t = steps[-1]
    if fixed < 2 * d:
        assert not p.fixed() and t <= 3 * d + 1e-9 and n > 100, steps[-5:]
    else:
        assert p.fixed() and n > 100 * pacing.MIN_TOKENS, steps[-5:]
        assert 2 * (d + fixed) <= t <= 3 * (d + fixed), steps[-5:]  # (the fixed part once, not on every step)


@pytest.mark.parametrize("fixed,p_tok", [(0.02, 0.0001), (0.005, 0.0002), (0.06, 0.0001)])
def test_pacer_of_flat_steps_learns_their_fixed_part_and_keeps_the_bound(fixed, p_tok):
    # chunks in the rows' forward (flat.py): a step costs d + F + n p. The pacer measures F at
    # MIN_TOKENS, probes LONG tokens once for p, then gives the prompt the room the bound leaves
    # (or at least F's worth of tokens); traced steps (a new graph: seconds) are no measure.
    # (the measured H200 case: d 22 ms, F ~20 ms, p ~0.1 ms a token)
    from mlxcel_dist.serve import pacing

    d = 0.022
    p = pacing.Pacer(3.0)
    p.observe(d, 4, 0)
    p.observe(2.0, 4, 8, flat=True, traced=True)  # a trace: ignored
    asked = []
    for _ in range(12):
        n = p.tokens() or 512
        asked.append(n)
        p.observe(d + fixed + p_tok * n, 4, n, flat=True)
    assert asked[:3] == [512, pacing.MIN_TOKENS, pacing.LONG], asked  # (512: the engine's own first budget)
    n = asked[-1]
    room = pacing.HEADROOM * 2 * d
    if fixed < room:
        assert n >= fixed / p_tok * 0.99 and n > pacing.LONG, asked  # not creeping in small chunks
        assert d + fixed + p_tok * n <= max(3 * d, d + 2 * fixed) + 1e-9, asked
    else:
        assert n >= 2 * (d + fixed) / p_tok * 0.99, asked  # few long steps


def test_pacer_of_flat_steps_survives_a_fixed_part_read_high():
    # seen on the H200: the 8-token flat step right after a trace took 75 ms, the 128-token probe
    # 32 ms (d 16 ms): F read high must not make a token free (it asked for 8192 tokens, steps of
    # 160-270 ms); chunks stay bounded and settle as later steps measure p
    from mlxcel_dist.serve import pacing

    d, F, p_tok = 0.016, 0.012, 0.0001
    p = pacing.Pacer(3.0)
    p.observe(d, 4, 0)
    p.observe(0.0755, 4, 8, flat=True)
    asked = [p.tokens()]
    assert asked == [pacing.LONG]
    for _ in range(30):
        n = asked[-1]
        p.observe(d + F + p_tok * n, 4, n, flat=True)
        asked.append(p.tokens())
    assert max(asked) < 2000, asked
    # F is then taken as the probe's whole extra (F + LONG tokens' work): the steps keep the rule's
    # bound for that F (at most d + 2 F), not for the true one
    F_read = F + pacing.LONG * p_tok
    assert d + F + p_tok * asked[-1] <= max(3 * d, d + 2 * F_read) + 1e-9, asked


def test_pacer_keeps_the_floor_where_tokens_themselves_cost_the_step():
    # late in a long prompt on a CPU a token costs a third of the step: 8 tokens break the
    # bound by their own work, which a long chunk's cost says too: no large chunks then
    from mlxcel_dist.serve import pacing

    p = pacing.Pacer(3.0)
    p.observe(0.085, 4, 0)
    p.observe(0.025 * 2048, 0, 2048)
    for _ in range(20):
        n = p.tokens() or 8
        p.observe(0.085 + 0.03 * n, 4, n)
    assert not p.fixed() and p.tokens() == pacing.MIN_TOKENS
    # np 2 late in a 4,000-token prompt: 8 tokens 160 ms beside a 55 ms step, a long chunk's
    # average 12 ms a token: the excess is attention's growth with position, not a fixed cost
    q = pacing.Pacer(3.0)
    q.observe(0.055, 4, 0)
    q.observe(0.012 * 2048, 0, 2048)
    for _ in range(20):
        q.observe(0.055 + 0.160, 4, 8)
    assert not q.fixed() and q.tokens() == pacing.MIN_TOKENS


def test_serve_refuses_a_token_budget_under_1():
    from typer.testing import CliRunner

    from mlxcel_dist.cli import app

    r = CliRunner().invoke(app, ["serve", "--max-num-batched-tokens", "0"])
    assert r.exit_code == 2 and "error: --max-num-batched-tokens must be >= 1, got 0" in r.output
    for args, message in ((["--max-stall", "1"], "--max-stall must be in [1.1, 100], got 1"),
                          (["--max-stall", "4", "--max-num-batched-tokens", "64"], "give one of them")):
        r = CliRunner().invoke(app, ["serve", *args])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and message in r.output, r.output


@pytest.mark.parametrize("d", CASES, ids=_ids)
def test_buffers_shrink_when_a_long_row_leaves_and_the_rest_keep_their_ids(d):
    # a long prompt (max 2 ids) and five short ones: when the long row leaves, the
    # streams no longer attend over its length, and when four more leave the one left
    # no longer computes eight buffer rows; every row's ids stay its ids alone
    model = load_model(d).model
    rng = np.random.default_rng(7)
    V = model.args.vocab_size
    short = [(i, rng.integers(3, V, 3 + i), GREEDY) for i in range(5)]
    long_ = (9, rng.integers(3, V, 70), GREEDY)
    want = {rid: alone(model, p, 14, s) for rid, p, s in short} | {9: alone(model, long_[1], 2)}
    eng = BatchEngine(model, prefill_step=16)
    eng.add_many([(rid, p, s, 14) for rid, p, s in short] + [(9, long_[1], GREEDY, 2)])
    got = {rid: [] for rid in want}
    seen = []  # (rows, buffer rows, slots) after each step's removals
    for step in range(12):
        for rid, t in eng.step().items():
            got[rid].append(t)
            if len(got[rid]) == (2 if rid == 9 else 8 if rid else 14):  # rows 1-4 leave after 8 ids
                eng.remove(rid)
        seen.append((len(eng), eng.store.capacity(), eng.store.slots()))
    assert got == {rid: ids[: len(got[rid])] for rid, ids in want.items()} and len(got[0]) == 12
    slots_with_long = seen[0][2]
    assert slots_with_long > 70 and seen[2][2] <= slots_with_long // 2, seen  # the long row gone: slots cut
    assert seen[-1][:2] == (1, 1), seen  # one row left: one buffer row, not 8


def test_a_prompts_last_chunk_and_its_placement_take_two_steps():
    # beside a decoding row, the step that runs a prompt's last chunk does not also grow the
    # buffers for its row and step it: the row joins after it (a chunk run alone: in the next
    # step; one riding in the rows' step, flat.py: once that step is read) and its first id is
    # launched by the next step; the ids stay the ids alone
    model = load_model(default_model_dir()).model
    rng = np.random.default_rng(5)
    V = model.args.vocab_size
    early, late = (0, rng.integers(3, V, 4), GREEDY), (1, rng.integers(3, V, 20), GREEDY)
    want = {rid: alone(model, p, 8) for rid, p, _ in (early, late)}
    eng = BatchEngine(model, prefill_step=16, budget=Budget(8))
    eng.add_many([(0, early[1], GREEDY, 8)])
    got = {0: [eng.step()[0]], 1: []}
    eng.add_many([(1, late[1], GREEDY, 8)])
    seen = []  # (prompt tokens prefilled so far, whether row 1 is placed) after each step
    while len(got[1]) < 8:
        for rid, t in eng.step().items():
            got[rid].append(t)
        seen.append((eng.prefilled, any(r.rid == 1 for r in eng.rows), len(got[1])))
        if len(got[0]) == 8 and 0 in eng:
            eng.remove(0)
    done = next(i for i, (n, *_) in enumerate(seen) if n == 19 + 3)  # the step of the last chunk (19 + 3 fed)
    assert seen[done + 1][1], seen  # placed by the next step
    assert (seen[done][2], seen[done + 1][2], seen[done + 2][2]) == (0, 0, 1), seen  # first launched by it
    assert got[1] == want[1] and got[0][:8] == want[0], (got, want)


@pytest.mark.parametrize("d", CASES, ids=_ids)
def test_a_prompt_that_reads_one_id_is_answered_from_its_prefill(d):
    # max_tokens 1 (lm-eval's loglikelihood, a classifier), asked twice (n = 2: a greedy copy
    # with logprobs and a sampled one) beside two decoding rows: drawn from the prompt's own
    # prefilled caches, it never takes a row, so the rows' buffers never grow to its length;
    # each id is the first id the same request gets as a row (max_tokens 2, alone), the rows
    # get an id every step and keep their ids alone
    model = load_model(d).model
    rng = np.random.default_rng(11)
    V = model.args.vocab_size
    early = [(0, rng.integers(3, V, 4), GREEDY), (1, rng.integers(3, V, 6), SamplingParams(temp=0.8, seed=2))]
    long_ = rng.integers(3, V, 100)  # past the first buffer's 64 slots
    sampled = SamplingParams(temp=1.0, seed=4)
    want = {rid: alone(model, p, 10, s) for rid, p, s in early}
    as_row = Generation(model, long_, 2, GREEDY, eos_ids=(), logprobs=2)
    first = list(as_row)[0]
    first_lp = as_row.finish().logprobs[0]
    first_sampled = alone(model, long_, 2, sampled)[0]
    assert alone(model, long_, 1) == [first]  # alone too: the id a row would draw

    eng = BatchEngine(model, prefill_step=16, budget=Budget(8))
    eng.add_many([(rid, p, s, 10) for rid, p, s in early])
    got = {0: [], 1: [], 7: [], 8: []}
    lps, most_slots, fed = {}, 0, True
    for step in range(40):
        if step == 2:
            eng.add_many([(7, long_, GREEDY, 1, None, True, None, 2), (8, long_, sampled, 1)])
        out = eng.step()
        assert not any(r.rid in (7, 8) for r in eng.rows), step
        running = [rid for rid in (0, 1) if rid in eng and len(got[rid]) < 10]
        fed = fed and all(rid in out for rid in running)
        for rid, t in out.items():
            got[rid].append(t)
            if rid == 7:
                lps[rid] = eng.logprobs.get(rid)
            if len(got[rid]) == (1 if rid >= 7 else 10):
                eng.remove(rid)
        most_slots = max(most_slots, eng.store.slots())
        if not len(eng) and not eng.prefilling:
            break
    assert got == {0: want[0], 1: want[1], 7: [first], 8: [first_sampled]}, (got, want, first, first_sampled)
    assert fed
    assert most_slots < len(long_), most_slots  # the rows never attended over the long prompt
    assert lps[7][1][0][0] == first and abs(lps[7][0] - first_lp[0]) < 1e-4, (lps, first_lp)


def test_a_paced_chunk_is_evaluated_with_the_decode_launch_on_its_own_stream(monkeypatch):
    # one process on a CPU: a paced step's prefill forward is built on the engine's side stream
    # and handed to the step's decode launch (one evaluation: two cores at once); the ids stay
    # the ids alone. Ranks that run collectives never do this (their order must match)
    import mlx.core as mx

    monkeypatch.setenv("MLXCEL_DIST_FLAT", "0")  # (chunks run alone, not in the rows' step: flat.py)

    if mx.default_device() != mx.cpu:
        pytest.skip("the side stream is for a CPU (MLX's CPU ops run on one thread each)")
    model = load_model(default_model_dir()).model
    rng = np.random.default_rng(9)
    V = model.args.vocab_size
    early, late = rng.integers(3, V, 4), rng.integers(3, V, 40)
    want = {0: alone(model, early, 12), 1: alone(model, late, 6)}
    eng = BatchEngine(model, prefill_step=16, budget=Budget(8))
    assert eng.side is not None
    handed = []
    take = eng.take_beside

    def spy():
        work = take()
        handed.append(len(work))
        return work

    eng.take_beside = spy
    eng.add_many([(0, early, GREEDY, 12)])
    got = {0: [eng.step()[0]], 1: []}
    eng.add_many([(1, late, GREEDY, 6)])
    while len(got[0]) < 12 or len(got[1]) < 6:
        for rid, t in eng.step().items():
            got[rid].append(t)
            if len(got[rid]) == (12 if rid == 0 else 6):
                eng.remove(rid)
        assert not eng.beside
    assert got == want, (got, want)
    assert sum(handed) >= 4  # the 39 prompt tokens' chunks, 8 a step, each handed to a launch
    model.ranks = 2
    try:
        assert BatchEngine(model).side is None
    finally:
        model.ranks = 1


FLAT = ["gemma3", "llama4", "gpt_oss", "gemma2", "qwen3_moe"]  # full + ring, chunked, sinks, softcap, experts


@pytest.mark.parametrize("fam", FLAT)
def test_a_chunk_in_the_rows_step_gives_the_ids_and_logprobs_of_a_chunk_alone(fam, monkeypatch):
    # flat.py: a prompt's chunks ride in the decoding rows' forward (one forward a step; taken on
    # a GPU, here by MLXCEL_DIST_FLAT=1); every row's ids and logprobs, the prompt's row's too, are
    # those of the same steps with each chunk run alone (=0), and the ids those of each request alone;
    # a prompt that reads one id (13) has its last token in its last chunk and is answered from it
    from mlxcel_dist.engine.flat import fusable

    model = load_model(FAMILY_CASES[fam]).model
    early, late = _requests(model.args.vocab_size, seed=6)
    late = [(10, np.resize(late[0][1], 70), GREEDY), late[1], (13, np.resize(late[1][1], 50), GREEDY)]
    n = 10
    budget = {13: 1}

    def run(flat: bool):
        monkeypatch.setenv("MLXCEL_DIST_FLAT", "1" if flat else "0")
        eng = BatchEngine(model, prefill_step=32, budget=Budget(12))
        eng.want = {rid: 2 for rid, *_ in early + late}
        eng.add_many([(rid, p, s, n) for rid, p, s in early])
        got, lps = {rid: [] for rid, *_ in early + late}, {rid: [] for rid, *_ in early + late}
        step = 0
        while len(eng) or eng.prefilling or step <= 2:
            if step == 2:
                assert fusable(eng) == flat
                eng.add_many([(rid, p, s, budget.get(rid, n)) for rid, p, s in late])
            out = eng.step()
            step += 1
            for rid, t in out.items():
                got[rid].append(t)
                lps[rid].append(eng.logprobs[rid][0])
                if len(got[rid]) >= budget.get(rid, n) and rid in eng:
                    eng.remove(rid)
        return got, lps, eng.flat is not None

    got, lps, used = run(True)
    ref, ref_lps, ref_used = run(False)
    assert used and not ref_used
    assert got == ref, (got, ref)
    assert got == {rid: alone(model, p, budget.get(rid, n), s) for rid, p, s in early + late}
    worst = max(abs(a - b) for rid in lps for a, b in zip(lps[rid], ref_lps[rid]))
    assert worst < 1e-4, worst


def test_flat_chunk_sizes_are_few_and_use_most_of_the_offer():
    from mlxcel_dist.engine.flat import chunk_size

    sizes = {chunk_size(n, 4096) for n in range(1, 4097)}
    assert len(sizes) <= 24, sorted(sizes)  # each size is a trace of the flat step
    for n in range(1, 3000):
        for cap in (1, 7, 32, 100, 2048):
            m = chunk_size(n, cap)
            assert 1 <= m <= min(n, cap)
            assert m > min(n, cap) * 2 / 3 - 1, (n, cap, m)  # at most a third of the offer unused


def test_a_second_prompt_beside_the_same_rows_traces_no_new_flat_graph(monkeypatch):
    # a GPU server traces each flat graph once in its life (100-270 ms of host time each on the
    # H200: the streams' longest gaps): a job's rings and buffers have sizes shared by every
    # prompt (prefill.FLAT_CHUNK, powers of two) and its last chunk keeps its size, so a second
    # prompt of another length, beside the same rows, runs on the graphs the first one traced
    import mlxcel_dist.engine.batch as batch
    import mlxcel_dist.engine.decode as decode

    monkeypatch.setenv("MLXCEL_DIST_FLAT", "1")
    monkeypatch.setattr(decode, "STEP", 256)  # (not this module's 8-slot buffers: the rows' buffers hold
    monkeypatch.setattr(batch, "CPU_STEP", 64)  # every step here, so no trace is theirs)
    model = load_model(FAMILY_CASES["gemma3"]).model  # full + sliding ring layers
    V = model.args.vocab_size
    rng = np.random.default_rng(4)
    eng = BatchEngine(model, prefill_step=64, budget=Budget(12))
    eng.add_many([(rid, rng.integers(3, V, 4), GREEDY, 200) for rid in range(3)])
    for _ in range(3):
        eng.step()

    def admit(rid, n):  # a prompt that reads one id: answered from its prefill's last chunk
        before, flat = eng.steps.traces, eng.flat_steps
        eng.add_many([(rid, rng.integers(3, V, n), GREEDY, 1)])
        got = {}
        while rid not in got:
            got.update(eng.step())
        assert eng.flat_steps - flat >= n // 16  # its chunks rode in the rows' steps
        return eng.steps.traces - before

    assert admit(10, 70) > 0  # the first prompt traced the flat graphs (the count counts)
    assert admit(11, 93) == 0
    assert admit(12, 41) == 0
    eng.budget = Budget(18)  # 15 tokens on offer: the 8 already run (at least half of it), no new size
    assert admit(13, 60) == 0
    # offers that move from step to step (the pacer's averages drift with the rows and the noise):
    # 6-30 tokens a step keep to the sizes run (8 covers 4-16, a new 24 or 32 the rest), not one each
    sizes = set(eng.flat_sizes)
    moving = np.random.default_rng(9)
    eng.add_many([(14, rng.integers(3, V, 300), GREEDY, 1)])
    got = {}
    while 14 not in got:
        eng.budget = Budget(int(moving.integers(9, 34)))
        got.update(eng.step())
    assert len(eng.flat_sizes - sizes) <= 1, (sorted(sizes), sorted(eng.flat_sizes))


def test_pacer_skips_one_step_a_first_kernel_compile_made_long():
    # seen on a fresh H200: an untraced step of 2.9 s (a kernel compiled for its shape) read as a
    # prompt token's cost made the pacer ask for 12 tokens, then walk back up through new sizes
    # (each a trace); one such step is skipped, two in a row are a real change
    from mlxcel_dist.serve import pacing

    d, F, p_tok = 0.016, 0.012, 0.00005
    p = pacing.Pacer(3.0)
    p.observe(d, 4, 0)
    for _ in range(8):
        n = p.tokens()
        p.observe(d + F + p_tok * n, 4, n, flat=True)
    n = p.tokens()
    p.observe(2.9, 4, n, flat=True)
    assert p.tokens() == n
    p.observe(2.2, 4, 0)  # the same for a plain step
    assert p.tokens() == n and p.decode_s < 0.02
    for _ in range(2):  # the rows' step really is slower now: taken
        p.observe(0.2, 4, 0)
    assert p.decode_s > 0.05


def test_a_flat_last_chunk_whose_pads_would_grow_the_buffers_takes_a_size_that_fits(monkeypatch):
    # seen on the H200: a 4,000-token prompt's last 32 tokens in a 384-token chunk grew its buffers
    # from 4,096 slots to 8,192 for pads alone (a new shape: an 8.7 s step with its kernel compiles);
    # here 60 tokens in chunks of 24: the last chunk (12 real) would write slots 48-71 past the 64
    # held, so it takes 16 (or a size run before that fits); the ids stay those of the prompt alone
    import mlxcel_dist.engine.prefill as prefill

    monkeypatch.setenv("MLXCEL_DIST_FLAT", "1")
    model = load_model(FAMILY_CASES["llama4"]).model
    V = model.args.vocab_size
    rng = np.random.default_rng(5)
    needs = []
    fit = prefill.Together._fit
    monkeypatch.setattr(prefill.Together, "_fit", lambda self, need: (needs.append(need), fit(self, need))[1])
    eng = BatchEngine(model, prefill_step=64, budget=Budget(27))  # 3 rows: 24 prompt tokens a step
    eng.add_many([(rid, rng.integers(3, V, 4), GREEDY, 40) for rid in range(3)])
    eng.step()
    prompt = rng.integers(3, V, 61)  # 60 prefilled, its last token the answer's input
    eng.add_many([(9, prompt, GREEDY, 1)])
    got = {}
    while 9 not in got:
        got.update(eng.step())
    assert 24 in eng.flat_sizes and max(needs) <= 64, (sorted(eng.flat_sizes), needs)
    assert [got[9]] == alone(model, prompt, 1)


def test_flat_chunks_keep_within_the_prefill_step(monkeypatch):
    # a flat job's chunk cap is a power of two (rings shared by every prompt), rounded up from a
    # short prompt's length but never past --prefill-step (48 here: not a power of two)
    monkeypatch.setenv("MLXCEL_DIST_FLAT", "1")
    model = load_model(FAMILY_CASES["gemma3"]).model
    V = model.args.vocab_size
    rng = np.random.default_rng(2)
    eng = BatchEngine(model, prefill_step=48, budget=Budget(200))
    eng.add_many([(rid, rng.integers(3, V, 4), GREEDY, 30) for rid in range(2)])
    eng.step()
    prompt = rng.integers(3, V, 101)
    eng.add_many([(9, prompt, GREEDY, 1)])
    got = {}
    while 9 not in got:
        got.update(eng.step())
    assert eng.flat_sizes and max(eng.flat_sizes) <= 48, sorted(eng.flat_sizes)
    assert [got[9]] == alone(model, prompt, 1)


def test_a_flat_prompts_first_id_is_drawn_from_its_last_chunk(monkeypatch):
    # in flat steps a prompt's last token rides in its last chunk and its row's first id (its
    # copies' too, each by its own choice: logprobs, a grammar) is drawn from that token's logits,
    # read with the step after that chunk's: one step sooner than a first step of the row's own
    # (a GPU: a long prompt's first token beside streams); the ids stay the ids alone
    pytest.importorskip("llguidance")
    from mlxcel_dist.engine import grammar
    from mlxcel_dist.checkpoint.loader import read_config
    from mlxcel_dist.checkpoint.tokenizer import Tokenizer

    monkeypatch.setenv("MLXCEL_DIST_FLAT", "1")
    d = default_model_dir()
    model = load_model(d).model
    tok = Tokenizer(d, read_config(d))
    vocab = grammar.Vocab(d / "tokenizer.json", model.args.vocab_size, tok.eos_ids)
    g = grammar.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                             "additionalProperties": False})
    rng = np.random.default_rng(8)
    V = model.args.vocab_size
    long, asked = rng.integers(3, V, 61), tok.encode("Answer in JSON. " * 6)
    n = 8
    eng = BatchEngine(model, prefill_step=16, vocab=vocab, budget=Budget(12))
    eng.want = {11: 2}
    eng.add_many([(rid, rng.integers(3, V, 4), GREEDY, 30) for rid in range(3)])
    for _ in range(2):
        eng.step()
    late = {10: long, 11: long, 12: asked}
    eng.add_many([(rid, p, GREEDY, n, g if rid == 12 else None) for rid, p in late.items()])
    got, lps, first, flat = {rid: [] for rid in late}, [], {}, []
    while any(len(got[rid]) < n for rid in late):
        before = eng.flat_steps
        out = eng.step()
        flat.append(eng.flat_steps > before)
        for rid, t in out.items():
            if rid in late and len(got[rid]) < n:
                first.setdefault(rid, len(flat) - 1)
                got[rid].append(t)
                if rid == 11:
                    lps.append(eng.logprobs[rid])
                if len(got[rid]) == n or t in tok.eos_ids:
                    got[rid] += [None] * (n - len(got[rid]))
                    eng.remove(rid)
    for rid in late:  # its first id read in the step after the one that launched its last chunk
        assert first[rid] >= 1 and flat[first[rid] - 1], (rid, first, flat)
    assert first[10] == first[11]  # a copy's id drawn with its source's
    assert got[10] == got[11] == alone(model, long, n)
    assert len(lps) == n and all(len(top) == 2 for _, top in lps)
    lone = BatchEngine(model, vocab=vocab)  # the constrained request alone
    lone.add_many([(12, asked, GREEDY, n, g)])
    ids = []
    while len(lone):
        ids.append(lone.step()[12])
        if len(ids) >= n or ids[-1] in tok.eos_ids:
            lone.remove(12)
    assert [t for t in got[12] if t is not None] == ids


def test_pacer_of_flat_steps_learns_a_tokens_cost_from_long_chunks():
    # seen on the H200 (12B gemma3, 4 rows decoding): flat steps of 512 tokens cost 34-44 ms as
    # those of 128 did, and a prompt's 64-token last chunk took 76 ms; read as a token's cost that
    # one step cut the next prompts to 128-token chunks (first token 3.5x alone where 512-token
    # chunks gave 1.7x). A token's cost now comes from chunks of LONG tokens or more
    from mlxcel_dist.serve import pacing

    d = 0.017
    p = pacing.Pacer(3.0)
    p.observe(d, 4, 0)
    p.observe(d + 0.010, 4, 8, flat=True)  # F
    p.observe(d + 0.025, 4, pacing.LONG, flat=True)  # the probe
    for _ in range(3):
        p.observe(0.035, 4, 512, flat=True)
    settled = p.tokens()
    assert settled >= 512, settled
    p.observe(0.076, 4, 64, flat=True)  # a last chunk, slow
    assert p.tokens() >= 0.9 * settled, (p.tokens(), settled)


def test_pacer_of_flat_steps_moves_on_when_the_engine_runs_more_than_asked():
    # seen on the H200: the first flat step ran 16 tokens (the engine's first offer), and asked for
    # MIN_TOKENS next the engine reused that size (a size run before, within twice the offer), so F,
    # measured at MIN_TOKENS or fewer, was never known and a 1,500-token prompt came in at 16 tokens a
    # step. F is now read from the short chunks that ran, and the pacer goes on to its probe
    from mlxcel_dist.serve import pacing

    d = 0.020
    p = pacing.Pacer(3.0)
    p.observe(d, 4, 0)
    asked = []
    for _ in range(6):
        n = max(p.tokens(), 16)  # the engine runs at least the 16-token chunk it ran first
        asked.append(p.tokens())
        p.observe(d + 0.012 + 0.00002 * n, 4, n, flat=True)
    assert pacing.LONG in asked and max(asked) > pacing.LONG, asked


def test_a_flat_chunk_takes_a_short_tail_instead_of_leaving_it_a_step(monkeypatch):
    # 1,600 tokens in 384-token chunks left a 64-token tail: a step of its own (49 ms on the H200,
    # a whole gap for the streams and a fifth of the prompt's steps). A chunk that would leave a
    # tail of at most a quarter of itself takes it, in a size run before (no new trace) up to
    # 1.5 x its own; ids as alone
    monkeypatch.setenv("MLXCEL_DIST_FLAT", "1")
    model = load_model(FAMILY_CASES["gemma3"]).model
    V = model.args.vocab_size
    rng = np.random.default_rng(11)
    eng = BatchEngine(model, prefill_step=64, budget=Budget(34))  # 32 prompt tokens a step beside 2 rows
    eng.add_many([(rid, rng.integers(3, V, 4), GREEDY, 40) for rid in range(2)])
    for _ in range(2):
        eng.step()
    eng.flat_sizes |= {32, 48}  # (as if earlier prompts had run them: the sizes this server has traced)
    late = rng.integers(3, V, 3 * 32 + 6)  # 96 + 6 tokens to prefill (the last one's too)
    eng.add_many([(9, late, GREEDY, 6)])
    chunks, ids = [], []
    while len(ids) < 6:
        before = eng.prefilled
        out = eng.step()
        if eng.prefilled > before:
            chunks.append(eng.prefilled - before)
        if 9 in out:
            ids.append(out[9])
    assert chunks == [32, 32, 38], chunks  # not 32, 32, 32, 6
    assert ids == alone(model, late, 6)
