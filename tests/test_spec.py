"""Speculative decoding (the engine's drafts, batch_spec.py, as generate and
bench run them): greedy ids identical to plain decoding in every family
whose layers hold attention KV (drafts accepted and rejected at every index,
rings wrapped, buffers regrown), draft-model rollback exact, prompt
lookup's matches, the sampling rule keeping the target's distribution (a
chi-square test on a Markov chain), the refusals (a target with a recurrent
or conv state among them), the CLI flags at np 1, and every family's
drafted ids (scripted, a draft model on every rank, prompt lookup) under
the real launcher at np 2."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlxcel_dist.cli import app
from mlxcel_dist.errors import UserError
from mlxcel_dist.cluster.launcher import launch
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.models import supported
from mlxcel_dist.engine.sampling import SamplingParams
from mlxcel_dist.engine.batch_spec import BatchDrafts, DraftRows
from mlxcel_dist.engine.spec import PromptLookup, speculative_accept

from reference_cases import FIXTURES, case_id, cases
from spec_drafts import ScriptedDrafts, misled, plain_ids, spec_ids

K = 3
N = 20  # generated ids: past every fixture's window + K from the short prompt


def _family_cases(drafting: bool) -> list:
    """Each family's first fp32 case (GQA ones first) whose target takes drafts
    (`drafting`: layers all attention KV) or is refused them (a recurrent or
    conv state; diffusion_gemma: its own loop)."""
    from mlxcel_dist.checkpoint.loader import build_model, open_model

    picked = {}
    for d in sorted(cases(), key=lambda d: not d.name.startswith("gqa")):
        fam = d.parent.name
        if fam in supported() and "fp32" in d.name and fam not in picked:
            model = build_model(open_model(d).config)
            kv = fam != "diffusion_gemma" and {c.static_form for c in model.make_cache()} <= {"kv", "shared"}
            picked[fam] = (case_id(d), kv)
    return sorted(c for c, kv in picked.values() if kv == drafting)


FAMILY_CASES = _family_cases(True)
REFUSED_CASES = _family_cases(False)


@pytest.fixture
def small_buffers(monkeypatch):
    import mlxcel_dist.engine.batch as batch

    monkeypatch.setattr(batch, "CPU_STEP", 8)  # full layers regrow within the generation


@pytest.mark.parametrize("case", FAMILY_CASES)
@pytest.mark.parametrize("prompt_len", [3, 19])
def test_greedy_drafts_give_the_plain_ids(case, prompt_len, small_buffers):
    # A 3-id prompt grows the rings towards window + K; a 19-id one starts
    # them full (windows 6..16). Eager blocks: the same buffers, masks and
    # rewinds as compiled ones (compiled below, for two families).
    d = FIXTURES / case
    model = load_model(d).model
    prompt = np.load(d / "reference.npz")["ids"][:prompt_len]
    want = plain_ids(model, prompt, N + K + 1)
    drafts = ScriptedDrafts(want, prompt_len, K, model.args.vocab_size)
    got, stats = spec_ids(model, prompt, N, drafts, compiled=False)
    assert got == want[:N]
    assert stats.accepted == drafts.expected  # every right draft accepted, none of the wrong ones
    assert stats.drafted == K * stats.rounds and stats.rounds < N
    assert drafts.rounds == stats.rounds  # a draft every step


def test_drafts_on_quantized_kv_rows_give_the_plain_ids(small_buffers):
    # --kv-bits rows (QuantizedRowCache) take drafts: a rejected position is
    # hidden by its position alone, as in float rows
    from mlxcel_dist.cache import KVOptions

    model = load_model(default_model_dir(), kv=KVOptions(bits=8, group_size=32)).model
    prompt = np.arange(3, 22)
    want = plain_ids(model, prompt, N + K + 1)
    drafts = ScriptedDrafts(want, len(prompt), K, model.args.vocab_size)
    got, stats = spec_ids(model, prompt, N, drafts)
    assert got == want[:N] and stats.accepted == drafts.expected and stats.rounds == drafts.rounds


def test_compiled_blocks_give_the_plain_ids(small_buffers):
    d = FIXTURES / "gemma3" / "gqa_fp32"
    model = load_model(d).model
    prompt = np.load(d / "reference.npz")["ids"][:3]
    want = plain_ids(model, prompt, N + K + 1)
    drafts = ScriptedDrafts(want, 3, K, model.args.vocab_size)
    got, stats = spec_ids(model, prompt, N, drafts)
    assert got == want[:N] and stats.accepted == drafts.expected


@pytest.mark.parametrize("case", ["gemma3/gqa_fp32", "gpt_oss/gqa_fp32", "llama/gqa_fp32"])
def test_draft_model_rolls_back_exactly(case, small_buffers):
    d = FIXTURES / case
    model, twin = load_model(d).model, load_model(d).model
    prompt = np.load(d / "reference.npz")["ids"][:3]
    want = plain_ids(model, prompt, N)
    drafter = misled(twin, K, compiled=False)  # eager steps: the same buffers and positions
    got, stats = spec_ids(model, prompt, N, drafter, compiled=False)
    assert got == want
    assert stats.accepted == drafter.draft.expected


@pytest.mark.parametrize("case", ["llama/gqa_fp32", "qwen3_moe/gqa_fp32"])
def test_split_steps_with_drafts_give_the_plain_ids(case, small_buffers):
    # Every layer full (no ring): the plain steps between rounds and the draft model's one-id steps
    # run split (fused decode attention on the prefix 0 .. pos, rejected drafts lying past it)
    d = FIXTURES / case
    model, twin = load_model(d).model, load_model(d).model
    prompt = np.load(d / "reference.npz")["ids"][:3]
    want = plain_ids(model, prompt, N)
    drafter = misled(twin, K)
    got, stats = spec_ids(model, prompt, N, drafter)
    assert got == want and stats.accepted == drafter.draft.expected
    assert model.engine.steps.splits(1) and drafter.draft.engine.steps.splits(1)
    # a lookup that never hits: every step the plain one, split as without drafts
    got, stats = spec_ids(model, prompt, N, BatchDrafts(K, lookup=PromptLookup(K, max_ngram=9, min_ngram=9)))
    assert got == want and stats.drafted == 0


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    pl = PromptLookup(3)
    assert pl.lookup([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]) == [5, 6, 7]  # "2 3": its latest earlier occurrence
    assert pl.lookup([1, 2, 3, 4, 5, 1, 2, 3, 8, 2, 3]) == [8, 2, 3]  # "2 3" latest at 6 ("1 2 3" is no suffix)
    assert pl.lookup([7, 8, 9, 1, 2, 7, 8, 9]) == [1, 2, 7]  # 3-gram
    assert pl.lookup([5, 6, 5]) == [6, 5]  # 1-gram, what is left
    assert pl.lookup([1, 2, 3]) == []
    assert pl.lookup([4]) == []


def test_prompt_lookup_gives_the_plain_ids_and_accepts_repeats():
    model = load_model(default_model_dir()).model
    prompt = np.array([2, 10, 11, 12, 13, 14, 15, 10, 11, 12, 13, 14, 15, 10, 11, 12], np.int32)
    want = plain_ids(model, prompt, 24)
    got, stats = spec_ids(model, prompt, 24, PromptLookup(K))
    assert got == want
    assert stats.drafted and stats.accepted <= stats.drafted


def test_speculative_sampling_keeps_the_target_distribution():
    # A Markov chain over 6 ids stands in for both models: the target's row
    # after id x is P[x], the draft's Q[x]. Each trial drafts K ids from Q,
    # verifies them with speculative_accept and keeps the first two ids it
    # yields (a second round when the first yields one); their joint counts
    # must follow P[t, a] P[a, b].
    V, trials = 6, 6000
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.ones(V) * 0.7, size=V).astype(np.float32)
    Q = (0.5 * rng.dirichlet(np.ones(V), size=V) + 0.5 * P).astype(np.float32)
    Q[:, 0] = 0  # the draft never proposes 0: the residual must supply it
    Q /= Q.sum(1, keepdims=True)
    logP, logQ = mx.log(mx.array(P)), mx.log(mx.array(Q))
    Q64 = Q / Q.sum(1, keepdims=True, dtype=np.float64)
    key = mx.random.key(1)
    counts = np.zeros((V, V))
    for _ in range(trials):
        ctx, out = [3], []
        while len(out) < 2:
            drafts = []
            for _ in range(K):  # drawn from Q on the host: the rule is what is tested
                drafts.append(int(rng.choice(V, p=Q64[(drafts or ctx)[-1]])))
            rows = [ctx[-1], *drafts]
            key, sub = mx.random.split(key)
            a, bonus = speculative_accept(logP[mx.array(rows)], mx.array(drafts), logQ[mx.array(rows[:-1])], sub)
            a, bonus = np.array(mx.stack([a, bonus])).tolist()
            emitted = drafts[:a] + [bonus]
            out += emitted
            ctx += emitted
        counts[out[0], out[1]] += 1
    expect = trials * P[3][:, None] * P
    keep = expect > 5
    chi2 = (((counts - expect) ** 2 / expect)[keep]).sum()
    dof = keep.sum() - 1
    assert chi2 < dof + 4 * np.sqrt(2 * dof), (chi2, dof)  # ~4 sigma; a wrong rule is off by thousands
    assert counts[:, 0].sum() > 0.5 * expect[:, 0].sum()


def test_sampled_drafts_are_reproducible_and_differ_by_seed():
    model = load_model(FIXTURES / "llama" / "gqa_fp32").model
    draft = BatchDrafts(K, DraftRows(load_model(FIXTURES / "llama" / "mqa_tied_fp32").model, K))
    prompt = np.load(FIXTURES / "llama" / "gqa_fp32" / "reference.npz")["ids"][:4]
    runs = [spec_ids(model, prompt, 12, draft, sampling=SamplingParams(temp=1.0, seed=s))[0] for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
    assert all(0 <= t < model.args.vocab_size for t in runs[2])


def test_refusals():
    from mlxcel_dist.engine.generation import Generation
    from mlxcel_dist.engine.spec import check_pair, check_target

    diffusion = load_model(FIXTURES / "diffusion_gemma" / "kv4_fp32").model
    with pytest.raises(UserError, match="its own generation loop"):
        Generation(diffusion, [1, 2], 4, spec=BatchDrafts(2))
    llama = load_model(FIXTURES / "llama" / "gqa_fp32").model
    with pytest.raises(UserError, match="repetition-penalty"):
        check_target(llama, SamplingParams(repetition_penalty=1.2))
    for case in REFUSED_CASES:  # a state cannot be rolled back by position
        with pytest.raises(UserError, match="its own generation loop|recurrent or conv state"):
            check_target(load_model(FIXTURES / case).model, None)
    with pytest.raises(UserError, match="cannot be a draft model"):
        check_pair(llama, load_model(FIXTURES / "recurrent_gemma" / "mqa_fp32").model)
    with pytest.raises(UserError, match="vocabulary"):
        check_pair(llama, load_model(default_model_dir()).model)
    with pytest.raises(UserError, match="--num-draft-tokens must be in \\[1, 64\\], got 0"):
        PromptLookup(0)


runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_refuses_bad_draft_options():
    for args, msg in [
        (["--draft-model", default_model_dir(), "--prompt-lookup"], "give one"),
        (["--draft-model", FIXTURES / "llama" / "gqa_fp32"], "vocabulary"),
        (["--draft-model", "/nonexistent-draft"], "--draft-model: /nonexistent-draft: no such model directory"),
        (["--prompt-lookup", "--num-draft-tokens", "0"], "--num-draft-tokens must be in [1, 64], got 0"),
        (["--prompt-lookup", "--num-draft-tokens", "100000"], "--num-draft-tokens must be in [1, 64], got 100000"),
        (["--prompt-lookup", "--json-object"], "not available with --json-schema / --json-object"),
    ]:
        r = run("generate", default_model_dir(), "-m", "4", *args)
        assert r.exit_code == 2, r.output
        assert r.output.count("error:") == 1 and msg in r.output, r.output


def test_cli_generate_and_bench_with_drafts():
    plain = run("generate", "-p", "The sea is calm. The sea is", "-m", "16", "--ignore-chat-template")
    assert plain.exit_code == 0, plain.output
    text = plain.stdout.splitlines()[0]
    for extra in (["--prompt-lookup"], ["--draft-model", default_model_dir(), "--num-draft-tokens", "2"]):
        r = run("generate", "-p", "The sea is calm. The sea is", "-m", "16", "--ignore-chat-template", "-v", *extra)
        assert r.exit_code == 0, r.output
        assert r.stdout.splitlines()[0] == text
        assert "mean accepted length" in r.stderr
    r = run("bench", "--prompt-tokens", "8", "--gen-tokens", "12", "--json", "--draft-model", default_model_dir())
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["gen_tokens"] == 12 and res["drafter"] == "draft model"
    assert res["accepted"] == res["drafted"] > 0  # the target drafting for itself: every draft right


HELPER = Path(__file__).parent / "helpers" / "spec_cases.py"


def test_drafts_under_pp_give_the_plain_text():
    # --pp 2: the verify blocks go through both stages (send/recv of [rows, K + 1, H]),
    # the logits reach every rank, every rank accepts alike
    import subprocess
    import sys

    def text(*extra):
        r = subprocess.run([sys.executable, "-m", "mlxcel_dist.cli", "generate", "-p", "The sea is calm. The sea is",
                            "-m", "16", "--ignore-chat-template", "-v", *extra], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()[0], r.stderr

    plain, _ = text()
    for extra in (["--prompt-lookup"], ["--draft-model", str(default_model_dir()), "--num-draft-tokens", "2"]):
        got, err = text("--np", "2", "--pp", "2", *extra)
        assert got == plain and "mean accepted length" in err, err
        if "--draft-model" in extra:  # the target drafting for itself: every draft right
            assert "accepted (100%)" in err, err


def test_greedy_drafts_give_the_plain_ids_at_np2(tmp_path):
    # One launch: every family's plain and drafted ids at np 2 (rank 0 writes them).
    code = launch([str(tmp_path), *[str(FIXTURES / c) for c in FAMILY_CASES]], 2, "mpi", script=HELPER)
    assert code == 0
    for c in FAMILY_CASES:
        r = np.load(tmp_path / f"{c.replace('/', '__')}.npz")
        assert r["plain"].tolist() == r["scripted"].tolist(), c
        assert int(r["accepted"]) == int(r["expected"]), c
    r = np.load(tmp_path / "draft_model.npz")
    assert r["plain"].tolist() == r["draft"].tolist() == r["lookup"].tolist()
    assert int(r["accepted"]) == int(r["expected"])
