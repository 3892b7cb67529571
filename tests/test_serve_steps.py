"""The scheduler and the rank step protocol in process, against a fake
engine: admission order and limits, cancellation, a failing request
isolated, shutdown, events held until the agreement verdict, and every rank
(rank 0 included) making the very same engine calls."""

import queue
import threading
from types import SimpleNamespace

import pytest

from mlxcel_dist.engine.guard import RankAgreement
from mlxcel_dist.checkpoint.loader import default_model_dir, read_config
from mlxcel_dist.engine.sampling import SamplingParams
from mlxcel_dist.serve import wire
from mlxcel_dist.engine.generation import OneRowEngine
from mlxcel_dist.models.base import Capabilities
from mlxcel_dist.serve.protocol import advance, apply_step, follow
from mlxcel_dist.serve.scheduler import Done, Failed, Job, Scheduler, Text, Token
from mlxcel_dist.serve.wire import KIND_SHUTDOWN, KIND_STEP, GenRequest
from mlxcel_dist.checkpoint.tokenizer import Tokenizer

POISON = 7  # a prompt holding this id makes the fake engine's add_many fail


@pytest.fixture(scope="module")
def tok():
    d = default_model_dir()
    return Tokenizer(d, read_config(d))


class FakeEngine:
    """BatchEngine's calls: each row's ids are `script[n]` of its prompt's
    first id's script (cycled), logged in `calls`."""

    prefilling = False  # its prompts take their rows at once
    prefilled = 0
    flat_steps = traces = micro_steps = 0

    def __init__(self, scripts=None):
        self.rows = {}
        self.calls = []
        self.want = {}
        self.logprobs = {}
        self.failed = {}
        self.prompt_logprobs = {}
        self.scripts = scripts or {}

    def __contains__(self, rid):
        return rid in self.rows

    def add_many(self, items):
        self.calls.append(("add_many", tuple((rid, tuple(p), mt) for rid, p, _, mt, *_ in items)))
        for rid, prompt, *_ in items:
            if POISON in prompt:
                raise ValueError("poisoned prompt")
        for rid, prompt, *_ in items:
            self.rows[rid] = [self.scripts.get(prompt[0], [prompt[0]]), 0]
        for r in items:  # the record's logprobs (prefill.Request), as BatchEngine.add_many takes them
            if r.logprobs is not None:
                self.want[r.rid] = r.logprobs

    def remove(self, rid):
        self.calls.append(("remove", rid))
        self.rows.pop(rid)
        self.want.pop(rid, None)

    def step(self, prefill=None, micro=0):
        self.calls.append(("step", tuple(sorted(self.rows))))
        out = {}
        for rid, r in self.rows.items():
            script, n = r
            out[rid] = script[n % len(script)]
            r[1] += 1
        self.logprobs = {rid: (-0.5, [(out[rid], -0.5)]) for rid in self.want if rid in out}
        return out


class Guard:
    count = checksum = last = 0

    def _record(self, tok):
        self.count += 1

    def _verdict(self, rows):
        pass


class Single:
    """A Link for one rank: the step crosses the wire encoding anyway."""

    class group:
        is_root = True

    def sync(self, guard, step=None):
        return wire.decode_step(wire.encode_step(step))


def req(prompt, max_tokens=4, **kw):
    return GenRequest(list(prompt), max_tokens, SamplingParams(temp=0.0), **kw)


def job(r):
    got = []
    return Job(r, got.append), got


def run_once(sched, engine, link=None):
    step, result = advance(engine, link or Single(), Guard(), sched.plan(), keep_logprobs=True,
                           agreed=sched.deliver)
    sched.absorb(step, result)
    return step


def drain(sched, engine, link=None):
    """Steps until every job is answered (plan() blocks once nothing is left)."""
    while sched.open or sched.outbox:
        run_once(sched, engine, link)


def words(tok, text):
    return tok.encode(text)[1:] if tok.bos_id is not None else tok.encode(text)


def test_admission_order_and_limits(tok):
    sched = Scheduler(tok, decode_concurrency=2, prompt_concurrency=1)
    eng = FakeEngine()
    jobs = [job(req([10 + i], max_tokens=3)) for i in range(4)]
    for j, _ in jobs:
        assert sched.submit(j)
    s1 = run_once(sched, eng)
    assert [r.prompt_ids for _, r in s1.admissions] == [[10]]  # one prompt per step (--prompt-concurrency 1)
    s2 = run_once(sched, eng)
    assert [r.prompt_ids for _, r in s2.admissions] == [[11]]
    s3 = run_once(sched, eng)  # both rows run; job 0 reaches max_tokens 3 here
    assert s3.admissions == []  # two rows: --decode-concurrency 2 is full
    s4 = run_once(sched, eng)
    assert [r.prompt_ids for _, r in s4.admissions] == [[12]] and len(s4.removals) == 1  # FIFO, into the freed row
    drain(sched, eng)  # the last events go out after one more verdict
    for j, got in jobs:
        assert isinstance(got[-1], Done) and got[-1].finish_reason == "length" and got[-1].completion_tokens == 3
    assert not eng.rows


def test_text_eos_stop_and_logprobs(tok):
    eos = tok.eos_ids[0]
    ids = words(tok, " The sea is calm")
    eng = FakeEngine({1000: ids + [eos]})
    sched = Scheduler(tok)
    plain, got_plain = job(req([1000], max_tokens=50, logprobs=1))
    stopped, got_stop = job(req([1000], max_tokens=50, stop=["is"]))
    past, got_past = job(req([1000], max_tokens=len(ids) + 3, ignore_eos=True))
    for j in (plain, stopped, past):
        sched.submit(j)
    drain(sched, eng)
    text = "".join(e.text for e in got_plain if isinstance(e, Text))
    assert text == tok.decode(ids)
    assert got_plain[-1] == Done("eos", 1, len(ids))  # the EOS is not counted, nor a Token event
    assert [e.id for e in got_plain if isinstance(e, Token)] == ids
    assert "".join(e.text for e in got_stop if isinstance(e, Text)) == " The sea "
    assert got_stop[-1].finish_reason == "stop" and got_stop[-1].stop == "is"
    assert got_past[-1] == Done("length", 1, len(ids) + 3)  # ignore_eos: EOS is an ordinary id
    assert not eng.rows


def test_metrics_count_what_the_rows_did(tok):
    """/metrics' counters after three requests: one to EOS, one to its
    length, one whose client left; stop_token_ids end a row as EOS does."""
    eos = tok.eos_ids[0]
    ids = words(tok, " The sea is calm")
    eng = FakeEngine({1000: ids + [eos], 2000: [7, 8, 9]})
    sched = Scheduler(tok)
    a, got_a = job(req([1000], max_tokens=50))
    b, got_b = job(req([2000, 3], max_tokens=2))
    c, got_c = job(req([2000], max_tokens=50, stop_ids=[9]))  # ends at its third id
    gone, _ = job(req([2000], max_tokens=50))
    for j in (a, b, c, gone):
        sched.submit(j)
    gone.cancelled.set()
    drain(sched, eng)
    assert got_a[-1] == Done("eos", 1, len(ids)) and got_b[-1] == Done("length", 2, 2)
    assert got_c[-1] == Done("eos", 1, 2)
    text = sched.metrics.render(running=0, waiting=0)
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if not line.startswith("#")}
    p = "mlxcel_dist_"
    assert values[f"{p}prompt_tokens_total"] == 1 + 2 + 1  # the cancelled one never took a row
    assert values[f"{p}generation_tokens_total"] == len(ids) + 2 + 2
    assert values[f'{p}request_success_total{{finished_reason="stop"}}'] == 2
    assert values[f'{p}request_success_total{{finished_reason="length"}}'] == 1
    assert values[f'{p}request_success_total{{finished_reason="abort"}}'] == 1
    assert values[f"{p}time_to_first_token_seconds_count"] == 3
    assert values[f"{p}time_per_output_token_seconds_count"] == len(ids) + 2 + 2 - 3
    assert values[f"{p}e2e_request_latency_seconds_count"] == 4
    buckets = [v for k, v in values.items() if k.startswith(f"{p}time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 3  # cumulative, +Inf last


def test_events_wait_for_the_verdict(tok):
    """A step's events are sent at the next sync, after its agreement check."""
    sched = Scheduler(tok)
    eng = FakeEngine({1000: words(tok, " one two three")})
    j, got = job(req([1000], max_tokens=1))
    sched.submit(j)
    run_once(sched, eng)
    assert got == []  # the id is read, but not yet agreed on
    run_once(sched, eng)
    assert isinstance(got[-1], Done)


def test_cancellation_frees_the_row(tok, capfd):
    sched = Scheduler(tok)
    eng = FakeEngine()
    a, got_a = job(req([20], max_tokens=100))
    b, got_b = job(req([21], max_tokens=3))
    sched.submit(a)
    sched.submit(b)
    run_once(sched, eng)
    run_once(sched, eng)
    sched.cancel(a)
    step = run_once(sched, eng)
    assert len(step.removals) == 1 and len(eng.rows) == 1
    assert "client gone: row freed after 2 of 100 tokens" in capfd.readouterr().err
    drain(sched, eng)
    assert got_b[-1].finish_reason == "length"
    # a job cancelled while queued never takes a row
    c, _ = job(req([22]))
    sched.submit(c)
    sched.cancel(c)
    step = run_once(sched, eng)
    assert step.admissions == [] and not eng.rows
    assert "request dropped before it took a row" in capfd.readouterr().err


def test_failing_admission_ends_that_request_alone(tok):
    sched = Scheduler(tok, prompt_concurrency=8)
    eng = FakeEngine()
    good, got_good = job(req([30], max_tokens=2))
    bad, got_bad = job(req([31, POISON], max_tokens=2))
    other, got_other = job(req([32], max_tokens=2))
    for j in (good, bad, other):
        sched.submit(j)
    drain(sched, eng)
    assert isinstance(got_bad[-1], Failed) and got_bad[-1].status == 500 and "poisoned" in got_bad[-1].message
    assert got_good[-1].finish_reason == "length" and got_other[-1].finish_reason == "length"
    # tried together, then one by one: the two good ones got their rows
    assert [c[0] for c in eng.calls[:4]] == ["add_many"] * 4


def test_failing_row_ends_that_request_alone(tok, monkeypatch):
    sched = Scheduler(tok)
    eng = FakeEngine()
    good, got_good = job(req([40], max_tokens=3))
    bad, got_bad = job(req([41], max_tokens=3))
    sched.submit(good)
    sched.submit(bad)
    run_once(sched, eng)
    row = next(r for r in sched.rows.values() if r.job is bad)

    def broken(_):
        raise RuntimeError("detokeniser broke")

    monkeypatch.setattr(row.text.decoder, "add", broken)
    drain(sched, eng)
    assert got_bad[-1] == Failed("generation failed: RuntimeError: detokeniser broke", 500)
    assert got_good[-1].finish_reason == "length"
    assert not eng.rows


def test_a_row_whose_grammar_gave_up_ends_its_request_with_a_400_alone(tok):
    # the engine names a row whose grammar llguidance gave up on at this step's id (StepResult.gave_up):
    # its request ends with an error naming llguidance, that id unsent and the row removed; the others go on
    sched = Scheduler(tok)
    eng = FakeEngine()
    good, got_good = job(req([40], max_tokens=3))
    bad, got_bad = job(req([41], max_tokens=3))
    sched.submit(good)
    sched.submit(bad)
    run_once(sched, eng)  # admissions and first ids
    rid = next(i for i, r in sched.rows.items() if r.job is bad)
    eng.gave_up = {rid: "max is 2000"}
    run_once(sched, eng)
    eng.gave_up = {}
    drain(sched, eng)
    assert isinstance(got_bad[-1], Failed) and got_bad[-1].status == 400
    assert "llguidance: max is 2000" in got_bad[-1].message and "after 1 tokens" in got_bad[-1].message
    assert sum(isinstance(e, Text) for e in got_bad) == 1  # its first id's; the id it gave up at: none
    assert sum(isinstance(e, Text) for e in got_good) == 3
    assert got_good[-1].finish_reason == "length" and not eng.rows


def test_shutdown_answers_every_open_request(tok):
    sched = Scheduler(tok, decode_concurrency=1)
    eng = FakeEngine()
    running, got_r = job(req([50], max_tokens=100))
    queued, got_q = job(req([51], max_tokens=100))
    sched.submit(running)
    sched.submit(queued)
    run_once(sched, eng)
    sched.stop()
    assert not sched.submit(job(req([52]))[0])  # refused once stopping
    step = run_once(sched, eng)
    assert step.kind == KIND_SHUTDOWN
    sched.deliver()
    assert got_r[-1] == Failed("the server is shutting down", 503)
    assert got_q[-1] == Failed("the server is shutting down", 503)


class Pair:
    """A two-rank link in memory: rank 0's encoded step reaches the follower."""

    def __init__(self):
        self.q = queue.Queue()

    def end(self, rank):
        pair = self

        class End:
            class group:
                is_root = rank == 0

            def sync(self, guard, step=None):
                if rank == 0:
                    msg = wire.encode_step(step)
                    pair.q.put(msg)
                else:
                    msg = pair.q.get(timeout=10)
                return wire.decode_step(msg)

        return End()


def test_every_rank_makes_the_same_engine_calls(tok):
    """Rank 0 (scheduler + advance) and a follower (follow = advance in a
    loop) over one link: the same engine calls in the same order, with a
    cancellation, a failing admission and shutdown among them."""
    pair = Pair()
    scripts = {60: words(tok, " a b c d e f g h")}
    eng0, eng1 = FakeEngine(scripts), FakeEngine(scripts)
    t = threading.Thread(target=follow, args=(eng1, pair.end(1), Guard()))
    t.start()
    sched = Scheduler(tok, decode_concurrency=3, prompt_concurrency=2)
    link = pair.end(0)
    jobs = [job(req([60 + (i % 2), *([POISON] if i == 3 else [])], max_tokens=3 + i)) for i in range(6)]
    for i, (j, _) in enumerate(jobs):
        sched.submit(j)
        run_once(sched, eng0, link)
        if i == 2:
            sched.cancel(jobs[1][0])
    drain(sched, eng0, link)
    sched.stop()
    assert run_once(sched, eng0, link).kind == KIND_SHUTDOWN
    t.join(10)
    assert not t.is_alive()
    assert eng0.calls == eng1.calls and len(eng0.calls) > 10
    assert isinstance(jobs[3][1][-1], Failed)
    assert sum(isinstance(got[-1], Done) for _, got in jobs) == 4  # one cancelled, one failed


def test_a_step_crosses_the_wire_bit_exact():
    """Rank 0 applies the decoded step too, so every rank samples with the same bits."""
    s = wire.Step(KIND_STEP, [3], [(5, GenRequest([1, 2], 9, SamplingParams(temp=0.1 + 0.2, top_p=0.3, seed=2**64 - 1),
                                                  ["x", "é"], 2, True)),
                               (6, GenRequest([4], 3, SamplingParams(), speculative=False))])
    got = wire.decode_step(wire.encode_step(s))
    assert got == s and got.admissions[0][1].sampling.temp == 0.1 + 0.2
    assert [r.speculative for _, r in got.admissions] == [True, False]  # the opt-out of drafts crosses too


@pytest.mark.parametrize("field,value", [("max_tokens", 2**31), ("top_k", 2**31), ("seed", 2**64),
                                         ("repetition_context_size", -1)])
def test_the_wire_refuses_what_it_cannot_hold(field, value):
    import dataclasses

    r = req([1, 2])
    if field == "max_tokens":
        r.max_tokens = value
    else:
        r.sampling = dataclasses.replace(r.sampling, **{field: value})
    with pytest.raises(ValueError, match=field):
        wire.encode_request(r)


class LoopModel(Capabilities):
    """A model with its own generation loop: yields `ids`, then stops (as at EOS)."""

    own_loop = True

    class args:
        vocab_size = 512
        model_type = "fake"

    def __init__(self, ids):
        self.ids = ids
        self.closed = 0

    def generate_ids(self, prompt, max_tokens, sampling, eos_ids, group):
        try:
            yield from self.ids[:max_tokens]
        finally:
            self.closed += 1


def test_one_row_engine_serves_a_model_with_its_own_loop(tok):
    from mlxcel_dist.parallel.collectives import SINGLE

    ids = words(tok, " The sea")
    model = LoopModel(ids)
    eng = OneRowEngine(model, SINGLE, tok.eos_ids)
    sched = Scheduler(tok, decode_concurrency=1, prompt_concurrency=1)
    a, got_a = job(req([5, 6], max_tokens=50))
    b, got_b = job(req([5, 6], max_tokens=1))
    sched.submit(a)
    sched.submit(b)
    drain(sched, eng)
    assert "".join(e.text for e in got_a if isinstance(e, Text)) == tok.decode(ids)
    assert got_a[-1] == Done("eos", 2, len(ids))  # the loop's end reads as its EOS
    assert got_b[-1] == Done("length", 2, 1)
    assert model.closed == 2  # each generation left its loop (removed at its end)


def test_apply_step_records_every_id_for_the_agreement_check():
    g = RankAgreement(every=0)
    eng = FakeEngine({70: [5, 6, 7]})
    apply_step(eng, wire.Step(KIND_STEP, [], [(0, req([70]))]), g)
    apply_step(eng, wire.Step(), g)
    assert g.count == 2 and g.last == 6
    assert apply_step(eng, wire.Step(wire.KIND_IDLE, idle_ms=5), g) is None


def test_logprobs_only_where_asked(tok):
    sched = Scheduler(tok)
    eng = FakeEngine()
    a, got_a = job(req([80], max_tokens=2, logprobs=3))
    b, got_b = job(req([81], max_tokens=2))
    sched.submit(a)
    sched.submit(b)
    drain(sched, eng)
    assert [e.logprob for e in got_a if isinstance(e, Token)] == [(-0.5, [(80, -0.5)])] * 2
    assert not any(isinstance(e, Token) for e in got_b)
    assert eng.want == {}  # asked per row, dropped with the row


def test_n_choices_take_rows_together_and_end_together(tok, monkeypatch):
    # A job of n choices: n rows admitted in one step (seed + i each), held
    # back until n rows are free; a Done per choice, its prompt counted once;
    # one choice failing ends the job once and frees its other rows.
    sched = Scheduler(tok, decode_concurrency=4)
    eng = FakeEngine()
    got_a, got_b = [], []
    a = Job(GenRequest([50], 2, SamplingParams(temp=0.0, seed=7)), got_a.append, n=3)
    b = Job(req([51], max_tokens=2), got_b.append, n=2)
    sched.submit(a)
    sched.submit(b)
    s1 = run_once(sched, eng)
    assert [r.sampling.seed for _, r in s1.admissions] == [7, 8, 9]  # b waits: 3 + 2 rows > 4
    assert [rid for rid, _ in s1.admissions] == [0, 1, 2] and sched.metrics.prompt_tokens == 1
    drain(sched, eng)
    done = [e for e in got_a if isinstance(e, Done)]
    assert sorted(e.index for e in done) == [0, 1, 2] and all(e.completion_tokens == 2 for e in done)
    assert sorted(e.index for e in got_b if isinstance(e, Done)) == [0, 1]
    assert sched.metrics.finished == {"length": 2}  # two requests, five rows
    bad_got = []
    bad = Job(req([52], max_tokens=4), bad_got.append, n=2)
    sched.submit(bad)
    run_once(sched, eng)
    row = next(r for r in sched.rows.values() if r.job is bad and r.index == 1)
    monkeypatch.setattr(row.text.decoder, "add", lambda _: (_ for _ in ()).throw(RuntimeError("detokeniser broke")))
    drain(sched, eng)
    assert [e for e in bad_got if isinstance(e, (Done, Failed))] == [
        Failed("generation failed: RuntimeError: detokeniser broke", 500)]
    assert not eng.rows and not sched.rows


def test_tokens_per_second_over_the_last_whole_seconds():
    from mlxcel_dist.serve.metrics import RATE_S, Metrics

    now = [100.0]
    m = Metrics(clock=lambda: now[0])
    for t in range(100, 100 + 2 * RATE_S):  # 3 tokens a second for 2 x RATE_S seconds
        for k in range(3):
            now[0] = t + k / 4
            m.token(now[0], first=False)
    now[0] = 100 + 2 * RATE_S + 0.5
    assert m.rate() == 3.0
    now[0] += RATE_S  # quiet since
    assert m.rate() == 0.0 and len(m.seconds) <= RATE_S + 1


def test_drafted_ids_share_their_step_in_time_per_output_token(tok):
    # a step with drafts gives a row several ids at once: each takes its share of
    # the gap since the row's previous step, not a gap of ~0 after the first
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    class DraftingEngine(FakeEngine):
        def step(self, prefill=None, micro=0):
            clock.t += 0.3  # every step 0.3 s; step 1 gives a row 1 id, later steps 3
            out = {}
            for rid, r in self.rows.items():
                script, n = r
                k = 1 if n == 0 else 3
                out[rid] = [script[(n + j) % len(script)] for j in range(k)]
                r[1] += k
            return out

    from mlxcel_dist.serve.metrics import Metrics

    clock = Clock()
    sched = Scheduler(tok)
    sched.metrics = Metrics(clock)
    a, got = job(req([1000], max_tokens=7))
    a.arrived = clock()
    sched.submit(a)
    import mlxcel_dist.serve.scheduler as scheduler_mod

    real = scheduler_mod.time.monotonic
    scheduler_mod.time.monotonic = clock
    try:
        drain(sched, DraftingEngine({1000: [5, 6, 7, 8, 9, 10, 11]}))
    finally:
        scheduler_mod.time.monotonic = real
    assert got[-1] == Done("length", 1, 7)
    tpot = sched.metrics.tpot
    assert sum(tpot.counts) == 6 and abs(tpot.sum - 6 * 0.1) < 1e-9  # 2 steps of 3 ids, 0.3 s each: 0.1 s an id
    assert tpot.counts[tpot.buckets.index(0.1)] == 6  # every one in (0.075, 0.1]: none ~0 s


def test_several_prompts_in_one_job_take_rows_prompt_by_prompt(tok):
    # A completions request of several prompts: n rows a prompt (seed + i),
    # choice p * n + i prompt p's i-th; the prompts join the batch together
    # where they fit, the rest as rows free up (FIFO: a later job waits);
    # each Done counts its own prompt.
    sched = Scheduler(tok, decode_concurrency=4, prompt_concurrency=8)
    eng = FakeEngine({60: [11, 12], 61: [13, 14], 62: [15, 16]})
    got, later = [], []
    many = Job(GenRequest([60], 2, SamplingParams(temp=0.0, seed=5)), got.append, n=2,
               prompts=[[60], [61, 61], [62, 62, 62]])
    other = Job(req([70], max_tokens=2), later.append)
    sched.submit(many)
    sched.submit(other)
    s1 = run_once(sched, eng)
    assert [(r.prompt_ids, r.sampling.seed) for _, r in s1.admissions] == [([60], 5), ([60], 6), ([61, 61], 5),
                                                                           ([61, 61], 6)]
    assert sched.metrics.prompt_tokens == 3  # each prompt once
    s2 = run_once(sched, eng)
    assert s2.admissions == []  # four rows run: the third prompt (and the later job) wait
    s3 = run_once(sched, eng)
    assert [r.prompt_ids for _, r in s3.admissions] == [[62, 62, 62]] * 2 + [[70]]  # the freed rows, `other` after
    drain(sched, eng)
    done = sorted((e.index, e.prompt_tokens) for e in got if isinstance(e, Done))
    assert done == [(0, 1), (1, 1), (2, 2), (3, 2), (4, 3), (5, 3)]
    texts = {}
    for e in got:
        if isinstance(e, Text):
            texts[e.index] = texts.get(e.index, "") + e.text
    assert texts[0] == texts[1] != texts[2] == texts[3] != texts[4]  # each choice its own prompt's rows
    assert [type(e) for e in later][-1] is Done


def test_next_idle_note_is_due_a_sleep_after_the_last_notes_sync(tok):
    # without a host channel the ranks meet in a collective after each idle note, and whoever comes
    # first spins there (MLX ring's wait is busy). The followers sleep from the note's sync end;
    # rank 0's next note must be due from there too, or a sync that waited on a late rank once
    # keeps rank 0 that much ahead (spinning) at every note after (an idle job at 73% of a core)
    import time

    from mlxcel_dist.serve.wire import KIND_IDLE

    sched = Scheduler(tok, sleeping_followers=False)
    sched.quiet_since = time.monotonic() - 10
    step = sched.plan()
    assert step.kind == KIND_IDLE
    time.sleep(0.25)  # the note's sync waited on a late rank
    t = time.monotonic()  # (read before absorb: no margin that a loaded box could overrun)
    sched.absorb(step, None)
    assert sched.idle_until >= t + step.idle_ms / 1000


@pytest.mark.parametrize("faster", [True, False])
def test_micro_batches_run_only_where_the_steps_times_show_they_pay(tok, monkeypatch, faster):
    """serve --micro-batches 2 (pipeline stages): each step's micro-batches
    cross the wire in the step and the engine runs them; a step in parts that
    takes longer than a whole one (two stages on one GPU, MLX's CPU backend)
    is tried for a few steps, then whole steps are kept, and where parts pay
    they are kept instead."""
    from mlxcel_dist.serve import pacing

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    seen = []

    class StagedEngine(FakeEngine):
        def step(self, prefill=None, micro=0):
            seen.append(micro)
            parts = micro > 1 and len(self.rows) > 1
            self.micro_steps += parts
            clock.t += (0.08 if faster else 0.15) if parts else 0.1  # a whole 8-row step: 0.1 s
            return super().step(prefill)

    sched = Scheduler(tok, decode_concurrency=8, micro=2)
    for i in range(8):
        sched.submit(job(req([1000 + i], max_tokens=200))[0])
    monkeypatch.setattr(pacing, "REPROBE", 1000)  # one trial of each mode in this run
    monkeypatch.setattr(__import__("time"), "monotonic", clock)
    drain(sched, StagedEngine({}))
    steps = len(seen)
    in_parts = sum(m == 2 for m in seen)
    assert set(seen) <= {1, 2} and steps >= 200
    if faster:
        assert in_parts >= steps - 2 * (pacing.PROBE + 2)  # whole steps only while timing them
    else:
        assert 0 < in_parts <= pacing.PROBE + 2  # parts tried once, then never again in this run


def test_micro_parts_try_the_other_mode_again_and_follow_a_change():
    from mlxcel_dist.serve.pacing import PROBE, REPROBE, MicroParts

    mp, cost = MicroParts(2), {1: 0.1, 2: 0.07}
    modes = []
    for i in range(3 * REPROBE):
        if i == REPROBE:
            cost[2] = 0.2  # the parts stop paying (load elsewhere, longer contexts)
        m = mp.choose(8)
        modes.append(m)
        mp.observe(cost[m] * 8, 8, 0, False, m == 2)
    assert modes[PROBE + 4 : REPROBE].count(2) == REPROBE - PROBE - 4  # parts kept while they pay
    assert modes[-REPROBE:].count(2) <= PROBE + 1  # after the change: whole, parts tried once more at most
    assert modes[REPROBE:].count(1) > 2 * REPROBE - 2 * (PROBE + 2) - REPROBE // 2  # switched within a reprobe


def test_micro_parts_time_only_plain_steps_and_end_a_trial_of_parts_that_cannot_run():
    from mlxcel_dist.serve.pacing import PROBE, MicroParts

    mp = MicroParts(2)
    for _ in range(PROBE):  # whole steps timed first: 0.1 s a row
        assert mp.choose(8) == 1
        mp.observe(0.8, 8, 0, False, False)
    for _ in range(3 * PROBE):  # the parts' trial: steps that prefilled or traced are no measure, however fast
        assert mp.choose(8) == 2
        mp.observe(0.08, 8, 64, False, True)
    for _ in range(3 * PROBE):
        assert mp.choose(8) == 2
        mp.observe(0.08, 8, 0, True, True)
    assert (8, 2) not in mp.per_row and mp.verdict is None
    for i in range(PROBE):
        mp.choose(8)
        mp.observe(1.6, 8, 0, False, True)  # 0.2 s a row in parts
        if i == 1:  # a step that launched nothing (every row at its budget) reads as run whole: no measure
            assert mp.choose(8) == 2
            mp.observe(0.01, 8, 0, False, False)
    b, timed = mp.verdict
    assert b == 8 and timed == pytest.approx({1: 0.1, 2: 0.2}) and mp.choose(8) == 1  # whole kept

    mp = MicroParts(2)  # parts asked for and run whole (a constrained row, a one-row buffer): they cannot run
    for _ in range(2 * PROBE + 1):
        mp.choose(1)
        mp.observe(0.1, 1, 0, False, False)
    assert mp.per_row[(1, 2)] == float("inf") and mp.use[1] == 1
    assert all(mp.choose(1) == 1 for _ in range(50))


def test_step_log_reports_the_loops_times_per_step_since_its_last_line(tok, monkeypatch, capfd):
    """MLXCEL_DIST_STEP_LOG's interval line: the steps since the last line
    and their times per step, the GC's time; nothing before REPORT_S or with
    no step since; its GC hook gone at close."""
    import gc

    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.serve import lifecycle

    sched = Scheduler(tok, decode_concurrency=4)
    eng = FakeEngine()
    for p in (50, 51):
        sched.submit(job(req([p], max_tokens=100))[0])
    run_once(sched, eng)  # (admission)
    eng.steps = SimpleNamespace(clock={"launch": 1.0, "eval": 0.5, "masks": 0.0, "upload": 0.0, "draw": 0.0,
                                       "read": 2.0, "deferred": 3})
    eng.vocab = SimpleNamespace(ahead_clock=[1.0, 1.0])
    eng.host_clock = lambda: BatchEngine.host_clock(eng)  # (the batch engine's: its steps' and its vocabulary's)
    report = lifecycle._Report(sched, eng)
    hooks = len(gc.callbacks)
    for _ in range(5):
        run_once(sched, eng)
    report()  # REPORT_S not yet passed
    assert "last " not in capfd.readouterr().err
    monkeypatch.setattr(lifecycle, "REPORT_S", 0.0)
    sched.times.rest += 0.005  # 1 ms a step of host time, as if measured
    clock = eng.steps.clock  # the engine's parts, as batch_step.Steps sums them: 5 steps' worth since the mark
    clock.update(launch=1.015, eval=0.506, masks=0.0025, upload=0.0005, draw=0.001, read=2.02, deferred=13)
    eng.vocab.ahead_clock[:] = [1.0005, 1.003]
    rest = 1e3 * (sched.times.rest - report.before.rest) / 5
    gc.collect()  # a full collection, timed by the report's hook
    report()
    line = capfd.readouterr().err
    assert "5 steps, 2.0 rows a step, 0 prompts; per step:" in line
    assert float(line.split("rest ")[1].split(" ")[0]) == pytest.approx(rest, abs=0.006)
    assert int(line.split("ms (")[1].split(" full")[0]) >= 1
    assert "MLX active" in line and "buffers" not in line  # (the fake engine has no row buffers)
    assert ("(launch 3.00 (MLX's start 1.20), grammar masks' wait 0.50 (their worker's start 0.10, compute 0.60), "
            "upload 0.10, their draw 0.20, read 4.00; 2.0 constrained rows a step)" in line)
    assert "s a second (this thread " in line
    report()  # no step since the last line: nothing
    assert "last " not in capfd.readouterr().err
    report.close()
    assert len(gc.callbacks) == hooks - 1
