"""Pipeline parallelism (--pp): stage_ranges' properties, per-stage loading,
and every family that runs in stages under the real launcher in every mode,
against the transformers reference and the single-process run (the TP
tests' tolerances)."""

import itertools
from fractions import Fraction
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import compare, rel_tol_for
from mlxcel_dist.checkpoint.loader import load_model, model_args, open_model, read_config
from mlxcel_dist.models import get_model_module
from mlxcel_dist.models.base import kv_sharing_cuts
from mlxcel_dist.parallel.pipeline import REFUSED, plan_stages, stage_of, stage_ranges

from reference_cases import (FIXTURES, assert_modes_match, case_id, cases, launched_results, short_length_of,
                             single_process_logits, window_of)
from testproc import run_cmd

HELPER = Path(__file__).parent / "helpers" / "pp_cases.py"


def _family(d):
    return get_model_module(read_config(d).get("model_type")).__name__.rsplit(".", 1)[-1]


def _layers(d):
    return model_args(read_config(d)).num_hidden_layers


def _cuts_into(d, P):
    """Whether the model has a legal cut into P stages (shared KV stays on one stage)."""
    m, refs = open_model(d).build()
    try:
        plan_stages(m, refs, P)
    except UserError:
        return False
    return True


CASES = [d for d in cases() if _family(d) not in REFUSED]
# MLX-quantized checkpoints (mlx-lm's logits are their reference): the quantized embedding's dtype crosses stages
QUANTIZED = [FIXTURES / "mlx_lm" / n for n in ("gemma3_q4", "llama_q4")]


def _reference(d):
    return d / ("reference.npz" if (d / "reference.npz").exists() else "mlx_lm_reference.npz")


# one case per family (its first with >= 4 layers, or its last)
_ONE_PER_FAMILY = list({d.parent.name: d for d in sorted(CASES, key=lambda d: _layers(d) >= 4)}.values())
# (backend, ranks, stages): ranks / stages tensor-parallel ranks per stage
def _tied(d) -> bool:
    return bool(getattr(model_args(read_config(d)), "tie_word_embeddings", False))


# pp 2: per family a case with a tied head and one with its own where the family has both (the last
# stage then holds the embedding matrix as its head, or an lm_head), the ring's two cases (the
# collective hand-off's runs are held to these) and the quantized checkpoints
_RING_PP2 = [FIXTURES / n for n in ("gemma3/gqa_bf16", "llama/mqa_tied_fp32")]
_PP2 = list({(d.parent.name, _tied(d)): d for d in sorted(CASES, key=lambda d: "fp32" in d.name)}.values())
RUNS = {
    ("mpi", 2, 2): list(dict.fromkeys(_PP2 + _RING_PP2)) + QUANTIZED,
    # 4 ranks on CI's 2 cores are slow: one case per fixture family (its first with a cut into 4:
    # >= 4 layers, and for gemma3n / gemma4 the KV-sharing layers with their sources, which no fixture has)
    ("mpi", 4, 4): list({d.parent.name: d for d in reversed(CASES) if _layers(d) >= 4 and _cuts_into(d, 4)}.values()),
    # a middle stage that hands on what it received: gemma4's per-layer inputs of the later layers
    ("mpi", 3, 3): [FIXTURES / "gemma4/dense_fp32"],
    # 2 stages of 2 tensor-parallel ranks: the block kinds (plain, parallel block, AltUp + shared KV,
    # MoE + sinks, recurrent, conv KV); every family was run so once (docs/benchmarks-log.md, issue 26)
    ("mpi", 4, 2): [d for d in _ONE_PER_FAMILY
                    if d.parent.name in ("llama", "cohere2", "gemma3n", "gpt_oss", "recurrent_gemma", "baichuan_m1")],
    # ring: send/recv over its sockets too, on two cases (its spinning receives make
    # every case slow on CI's 2 cores); 6 ranks: 2 stages of 3 (uneven heads)
    ("ring", 2, 2): _RING_PP2,
    ("mpi", 6, 2): [FIXTURES / "llama/gqa_fp32"],
}
# every launch: harness.short_length tokens (as tests/test_tp.py's SHORT: each mode still crosses
# the window twice and feeds the short sequence as it feeds the whole one)
SHORT = set(RUNS)
COMBOS = [(*k, d) for k, ds in RUNS.items() for d in ds]


# stage_ranges ----------------------------------------------------------------
def _brute(w, P, first, last, allowed=None, weights=None):
    n = len(w)
    share = [Fraction(1)] * P if weights is None else [Fraction(x) for x in weights]
    best = None
    for cuts in itertools.combinations(range(1, n) if allowed is None else sorted(allowed), P - 1):
        b = (0, *cuts, n)
        cost = max((sum(w[b[k]:b[k + 1]]) + (first if k == 0 else 0) + (last if k == P - 1 else 0)) / share[k]
                   for k in range(P))
        best = cost if best is None else min(best, cost)
    return best


def _stage_cost(w, r, first, last, weights):
    return max((sum(w[a:b]) + (first if k == 0 else 0) + (last if k == len(r) - 1 else 0)) / Fraction(weights[k])
               for k, (a, b) in enumerate(r))


def test_stage_ranges_with_weights_minimise_bytes_per_weight():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 8)
        P = rng.randint(1, n)
        w = [rng.choice([0, 1, rng.randint(1, 1000)]) for _ in range(n)]
        first, last = rng.choice([0, rng.randint(0, 2000)]), rng.choice([0, rng.randint(0, 2000)])
        weights = [Fraction(rng.randint(1, 6), rng.choice([1, 2, 3])) for _ in range(P)]
        r = stage_ranges(w, P, first, last, weights=weights)
        assert len(r) == P and r[0][0] == 0 and r[-1][1] == n and all(a < b for a, b in r), r
        assert all(r[k][1] == r[k + 1][0] for k in range(P - 1)), r
        assert _stage_cost(w, r, first, last, weights) == _brute(w, P, first, last, weights=weights), (w, weights, r)
        assert r == stage_ranges(w, P, first, last, weights=weights)  # deterministic
        # equal weights are the unweighted split; scaling every weight changes nothing
        assert stage_ranges(w, P, first, last, weights=[weights[0]] * P) == stage_ranges(w, P, first, last)
        assert stage_ranges(w, P, first, last, weights=[3 * x for x in weights]) == r
    # 8 equal layers, the first stage 3 times the second: 6 and 2
    assert stage_ranges([1] * 8, 2, weights=[3, 1]) == [(0, 6), (6, 8)]
    with pytest.raises(UserError, match="3 stage weights for --pp 2"):
        stage_ranges([1] * 8, 2, weights=[1, 1, 1])


def test_stage_ranges_properties():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        P = rng.randint(1, n)
        w = [rng.choice([0, 1, 5, rng.randint(1, 1000)]) for _ in range(n)]
        first, last = rng.choice([0, rng.randint(0, 3000)]), rng.choice([0, rng.randint(0, 3000)])
        r = stage_ranges(w, P, first, last)
        assert len(r) == P and r[0][0] == 0 and r[-1][1] == n
        assert all(a < b for a, b in r), r  # every stage holds >= 1 layer
        assert all(r[k][1] == r[k + 1][0] for k in range(P - 1)), r  # contiguous
        cost = max(sum(w[a:b]) + (first if k == 0 else 0) + (last if k == P - 1 else 0)
                   for k, (a, b) in enumerate(r))
        assert cost == _brute(w, P, first, last), (w, P, first, last, r)
        assert r == stage_ranges(w, P, first, last)  # deterministic: every rank computes the same
        allowed = {c for c in range(1, n) if rng.random() < 0.6}
        if len(allowed) < P - 1:
            with pytest.raises(UserError, match=f"at most --pp {len(allowed) + 1}"):
                stage_ranges(w, P, first, last, cuts=allowed)
            continue
        r = stage_ranges(w, P, first, last, cuts=allowed)
        assert {a for a, _ in r[1:]} <= allowed and r[0][0] == 0 and r[-1][1] == n, (allowed, r)
        cost = max(sum(w[a:b]) + (first if k == 0 else 0) + (last if k == P - 1 else 0)
                   for k, (a, b) in enumerate(r))
        assert cost == _brute(w, P, first, last, allowed), (w, P, allowed, r)


def test_kv_sharing_cuts():
    # gemma3n/gqa_fp32's sharing: layers 3, 4 read layer 1, layer 5 reads layer 2
    assert kv_sharing_cuts([None, None, None, 1, 1, 2]) == [1]
    assert kv_sharing_cuts([None, None, None, None, 3, 2]) == [1, 2]  # gemma4/dense_fp32
    assert kv_sharing_cuts([None] * 4) == [1, 2, 3]
    for d in (FIXTURES / f for f in ("gemma3n/gqa_fp32", "gemma4/dense_fp32", "gemma4/moe_fp32")):
        m, refs = open_model(d).build()
        src = m.args.kv_source
        for P in (2, 3):
            if not _cuts_into(d, P):
                continue
            for a, b in plan_stages(m, refs, P):
                assert all(a <= s for s in src[a:b] if s is not None), (d, P, a, b)  # every source on the stage


def test_stage_ranges_balance_and_refusals():
    assert stage_ranges([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_ranges([1] * 6, 2, first_extra=2) == [(0, 2), (2, 6)]  # the embedding weighs on stage 0
    with pytest.raises(UserError, match="--pp 5 needs at least 5 layers, the model has 4"):
        stage_ranges([1] * 4, 5)
    with pytest.raises(UserError, match="--pp must be >= 1"):
        stage_ranges([1] * 4, 0)


# per-stage loading (a planned group: no collective runs) -----------------------
@pytest.mark.parametrize("name", ["llama/gqa_fp32", "llama/mqa_tied_fp32", "gemma3/multimodal_fp32",
                                  "gemma3n/mqa_untied_fp32", "gemma4/moe_fp32", "recurrent_gemma/mqa_fp32"])
def test_each_stage_holds_and_reads_only_its_parameters(name):
    from mlx.utils import tree_flatten

    from mlxcel_dist.checkpoint import weights
    from mlxcel_dist.parallel.pipeline import stage_parts

    d = FIXTURES / name
    full = {n: int(p.nbytes) for n, p in tree_flatten(load_model(d).model.parameters())}
    tied = model_args(read_config(d)).tie_word_embeddings
    seen, total = set(), 0
    for r in range(2):
        before = weights.bytes_read
        m = load_model(d, group=Group.planned(2, r), pp=2).model
        read = weights.bytes_read - before
        names = {n for n, _ in tree_flatten(m.parameters())}
        s = m.model.stage
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(range(s.start, s.stop)), (r, layers)
        assert ("model.embed_tokens.weight" in names) == (r == 0 or tied)
        first, last = stage_parts(m.model)

        def holds(part, among):
            return any(n.startswith(f"model.{part}.") for n in among)

        for part in (p for p in first if holds(p, full)):  # e.g. gemma3n's per-layer embeddings: stage 0 only
            assert holds(part, names) == (r == 0 or (part == "embed_tokens" and tied)), (r, part)
        for part in last:  # the final norm (gemma3n: and the AltUp unembedding): the last stage only
            assert holds(part, names) == (r == 1), (r, part)
        assert any(n.startswith("lm_head.") for n in names) == (r == 1 and not tied)
        assert names <= set(full)
        assert read == sum(full[n] for n in names)  # fp32 checkpoints: stored bytes = held bytes
        seen |= names
        total += read
    assert seen == set(full)  # the stages together hold the whole model


# refusals, before launch --------------------------------------------------------
def _cli(*args, timeout=120, cwd=None):
    return run_cmd([sys.executable, "-m", "mlxcel_dist.cli", *map(str, args)], timeout=timeout, cwd=cwd)


def test_refusals_are_one_line(tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(8))
    out = tmp_path / "o.npy"
    checks = [
        (["logits", FIXTURES / "diffusion_gemma/kv4_fp32", "--tokens-file", ids, "--out", out, "--pp", "2"],
         "error: --pp: diffusion_gemma_text (diffusion_gemma) cannot run in pipeline stages: "),
        (["logits", FIXTURES / "gemma3n/gqa_fp32", "--tokens-file", ids, "--out", out, "--pp", "3"],
         "error: --pp 3 needs 2 stage boundaries, but this model's 6 layers can be cut only before layer(s) 1 "
         "(a layer that reads another layer's KV stays on that layer's stage): at most --pp 2"),
        (["logits", FIXTURES / "llama/gqa_fp32", "--tokens-file", ids, "--out", out, "--pp", "2", "--np", "3"],
         "error: --np 3 is not a multiple of --pp 2"),
        (["logits", FIXTURES / "llama/mqa_tied_fp32", "--tokens-file", ids, "--out", out, "--pp", "5"],
         "error: --pp 5 needs at least 5 layers, the model has 4"),
        (["logits", FIXTURES / "llama/gqa_fp32", "--tokens-file", ids, "--out", out, "--pp", "2",
          "--rank-weights", "3,1,1"], "error: --rank-weights gives 3 weights for 2 ranks"),
        # no path: before launch (nccl is refused so even where it cannot start)
        (["logits", FIXTURES / "llama/gqa_fp32", "--tokens-file", ids, "--out", out, "--pp", "2",
          "--backend", "nccl", "--pp-handoff", "send"], "error: --pp-handoff send: backend nccl has no point-to-point"),
        (["logits", FIXTURES / "llama/gqa_fp32", "--tokens-file", ids, "--out", out, "--pp", "2", "--np", "4",
          "--backend", "nccl"], "error: --np 4 --pp 2 on backend nccl: 2 tensor-parallel ranks per stage need"),
    ]
    for argv, line in checks:
        p = _cli(*argv, cwd=tmp_path)
        assert p.returncode == 2, (argv, p.stdout, p.stderr)
        assert p.stderr.splitlines() == [p.stderr.strip()] and p.stderr.startswith(line), p.stderr
        assert not out.exists()


def test_every_family_runs_in_stages_or_is_refused():
    from mlxcel_dist.models import supported

    files = {get_model_module(t).__name__.rsplit(".", 1)[-1] for t in supported()}
    staged = {f for f in files if get_model_module(f).Model.pipeline_stages}
    assert staged | set(REFUSED) == files and not staged & set(REFUSED)
    assert {_family(d) for d in CASES} == staged  # every family that runs in stages is tested


# under the launcher ---------------------------------------------------------------
@pytest.fixture(scope="module")
def single():
    return {d: single_process_logits(d, _reference(d).name) for d in CASES + QUANTIZED}


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory):
    """One launch per (backend, pp), all its cases in one job, run on first use."""
    return launched_results(tmp_path_factory, RUNS, str(HELPER), "pp", str, SHORT)


def _tol(d):
    return rel_tol_for("bfloat16" if "bf16" in d.name else "float32")


def _run_id(b, n, P, d):
    return f"{b}-pp{P}" + (f"x{n // P}" if n > P else "") + f"-{case_id(d)}"


# Every family at pp 2 x tp 2, ending in compiled decode steps, once per backend: the
# job must exit 0 (issue 41: under mpirun a rank whose run ended so never finalized
# MPI). One job per backend, not one per family: the failure is the process's (a
# reference MLX keeps to the MPI group past exit), so one family that leaves it fails
# the whole job (gemma4 then llama failed), and each family's logits are checked.
DECODE_RUNS = {(b, 4, 2, "--decode"): _ONE_PER_FAMILY for b in ("mpi", "ring")}


@pytest.fixture(scope="module")
def decode_results(tmp_path_factory):
    return launched_results(tmp_path_factory, DECODE_RUNS, str(HELPER), "ppdecode", str)


@pytest.mark.parametrize("backend", ["mpi", "ring"])
@pytest.mark.parametrize("d", _ONE_PER_FAMILY, ids=case_id)
def test_every_family_pp2x2_decodes_and_exits_0(decode_results, backend, d):
    from helpers.pp_cases import DECODE_STEPS, DECODE_TOKENS
    from mlxcel_dist.engine.generation import sequence_logits
    from reference_cases import _model

    out = decode_results(backend, 4, 2, "--decode")  # asserts the job's exit code 0
    with np.load(out / f"{d.parent.name}__{d.name}.npz") as z:
        got = z["decode"]
    ids = np.load(_reference(d))["ids"][:DECODE_TOKENS]
    one = sequence_logits(_model(d), ids, decode_from=DECODE_TOKENS - DECODE_STEPS)
    for what, want in (("reference", np.load(_reference(d))["logits"][:DECODE_TOKENS]), ("np1", one)):
        r = compare(got, want, _tol(d))
        assert r["ok"], (backend, case_id(d), "vs", what, r)


def test_logits_pp2x2_decode_exits_0_under_mpi(tmp_path):
    # the reported command (gemma4: exit 1 after writing the right logits)
    d = FIXTURES / "gemma4/dense_fp32"
    ids = tmp_path / "ids.npy"
    np.save(ids, np.load(_reference(d))["ids"][:24])
    out = tmp_path / "o.npy"
    p = _cli("logits", d, "--tokens-file", ids, "--out", out, "--np", 4, "--pp", 2, "--decode-from", 20,
             "--backend", "mpi", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip().splitlines() == [f"wrote {out} [24, 256] float32 (np 4, pp 2: layers [0, 2) [2, 6))"]
    r = compare(np.load(out), np.load(_reference(d))["logits"][:24], _tol(d))
    assert r["ok"], r


@pytest.mark.parametrize("backend,n,P,d", COMBOS, ids=[_run_id(*c) for c in COMBOS])
def test_pp_matches_reference_and_single_process(pp_results, single, backend, n, P, d):
    out = pp_results(backend, n, P)
    key = f"{d.parent.name}__{d.name}"
    ranks = [json.loads((out / f"{key}.rank{r}.json").read_text()) for r in range(n)]
    assert [(r["index"], r["member"]) for r in ranks] == [stage_of(r, n, P)[:2] for r in range(n)]
    stages = [ranks[s * (n // P)] for s in range(P)]
    assert stages[0]["start"] == 0 and stages[-1]["stop"] == _layers(d)
    assert all(stages[k]["stop"] == stages[k + 1]["start"] for k in range(P - 1))
    for r in ranks:  # a stage's ranks hold its layers only
        layers = {int(x.split(".")[2]) for x in r["names"] if x.startswith("model.layers.")}
        assert layers == set(range(r["start"], r["stop"]))
    rows = short_length_of(d) if (backend, n, P) in SHORT else None
    assert_modes_match(out / f"{key}.npz", np.load(_reference(d))["logits"], single[d], _tol(d), (backend, n, P),
                       rows, window_of(d))


# --pp-handoff collective (no send/recv: MLX's NCCL backend has none) against the send/recv
# runs above, bit for bit: over the whole group (ring: NCCL's own path, as it cannot split
# either; pp 3: a middle stage's hops and gemma4's per-stage message widths) and over split
# groups at pp 2 and pp 2 x tp 2 (mpi: the hop's group and a SplitGroup inside each stage; cohere2's
# parallel block, gemma3n's packed AltUp streams, the recurrent block)
# (backend, ranks, stages) -> the send/recv run it is held to (at pp 3 x tp 1 MPI's: one rank a
# stage, nothing summed but the logits with zeros, so the backend changes no bit)
AGAINST = {("ring", 2, 2): ("ring", 2, 2), ("ring", 3, 3): ("mpi", 3, 3), ("mpi", 4, 2): ("mpi", 4, 2),
           ("mpi", 2, 2): ("mpi", 2, 2)}
COLLECTIVE_RUNS = {
    ("ring", 2, 2, "--collective"): RUNS[("ring", 2, 2)],
    ("mpi", 2, 2, "--collective"): RUNS[("ring", 2, 2)],  # a two-rank split group per hop
    ("ring", 3, 3, "--collective"): RUNS[("mpi", 3, 3)],
    ("mpi", 4, 2, "--collective"): [d for d in RUNS[("mpi", 4, 2)]
                                    if d.parent.name in ("cohere2", "gemma3n", "recurrent_gemma")],
}
SHORT_COLLECTIVE = {k for k in COLLECTIVE_RUNS if AGAINST[k[:3]] in SHORT}  # the same tokens as the send run
COLLECTIVE_COMBOS = [(*k[:3], d) for k, ds in COLLECTIVE_RUNS.items() for d in ds]


@pytest.fixture(scope="module")
def collective_results(tmp_path_factory):
    return launched_results(tmp_path_factory, COLLECTIVE_RUNS, str(HELPER), "ppcoll", str, SHORT_COLLECTIVE)


@pytest.mark.parametrize("backend,n,P,d", COLLECTIVE_COMBOS, ids=[_run_id(*c) for c in COLLECTIVE_COMBOS])
def test_collective_handoff_equals_send_recv(pp_results, collective_results, backend, n, P, d):
    key = f"{d.parent.name}__{d.name}.npz"
    sent = pp_results(*AGAINST[(backend, n, P)]) / key
    got = collective_results(backend, n, P, "--collective") / key
    with np.load(sent) as a, np.load(got) as b:
        assert set(a.files) == set(b.files)
        for mode in a.files:
            assert np.array_equal(a[mode], b[mode]), (backend, n, P, case_id(d), mode)


def test_bench_counts_the_collective_handoff(tmp_path):
    # ring, one rank a stage: NCCL's path; a hop is one all_gather of [1, 1, H] that the plan counts too
    p = _cli("bench", "--pp", "2", "--pp-handoff", "collective", "--backend", "ring", "--prompt-tokens", 20,
             "--gen-tokens", 8, "--json", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    b = json.loads(p.stdout)
    assert b["all_gathers_per_token"] == b["all_gathers_per_token_plan"] == 1
    assert b["all_gather_bytes_per_token"] == b["all_gather_bytes_per_token_plan"] > 0
    assert b["all_sums_per_token"] == b["all_sums_per_token_plan"] == 2


@pytest.mark.parametrize("backend,requested,T,want", [
    ("ring", "auto", 1, "send"), ("ring", "collective", 1, "collective"), ("ring", "send", 2, "send"),
    ("mpi", "auto", 2, "send"), ("mpi", "collective", 2, "collective"), ("nccl", "auto", 1, "collective"),
    ("nccl", "collective", 1, "collective"), ("jaccl", "auto", 2, "send"), (None, "auto", 2, "send"),
    ("nccl", "send", 1, "error: --pp-handoff send: backend nccl has no point-to-point ops"),
    ("nccl", "auto", 2, "error: --np 4 --pp 2 on backend nccl: 2 tensor-parallel ranks per stage need"),
    ("ring", "collective", 2, "error: --np 4 --pp 2 on backend ring: 2 tensor-parallel ranks per stage need"),
    ("jaccl", "collective", 2, "error: --np 4 --pp 2 on backend jaccl"),
    ("mpi", "recv", 1, "error: --pp-handoff must be one of auto, send, collective"),
])
def test_handoff_mode_per_backend(backend, requested, T, want):
    from mlxcel_dist.parallel.pipeline import handoff_mode

    if not want.startswith("error: "):
        assert handoff_mode(requested, backend, 2, T) == want
        return
    with pytest.raises(UserError) as e:
        handoff_mode(requested, backend, 2, T)
    assert f"error: {e.value}".startswith(want), e.value


def test_generate_pp2_prints_the_same_text_as_np1(tmp_path):
    # the embedded default model (gemma3-tiny), greedy: the compiled decode step runs in stages
    argv = ["generate", "--prompt", "The sea", "-n", "40", "--verbose"]
    one = _cli(*argv, cwd=tmp_path, timeout=120)
    two = _cli(*argv, "--pp", "2", cwd=tmp_path, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    assert two.stdout == one.stdout and len(one.stdout) > 20
    assert "np 2, pp 2" in two.stderr and "ranks agreed" in two.stderr


def test_logit_match_pp(tmp_path):
    d = FIXTURES / "gemma2/gqa_fp32"
    p = _cli("logit-match", d, "--pp", "2", "--reference", d / "reference.npz", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pp2 vs np1" in p.stdout and "pp2 vs reference" in p.stdout and " NO" not in p.stdout


def test_logit_match_pp_with_rank_weights(tmp_path):
    # stage 0 (weight 3) takes 5 of llama/gqa_fp32's 6 layers, stage 1 the last and
    # the head; the ranks get the weights through their argv and cut alike
    d = FIXTURES / "llama/gqa_fp32"
    m, refs = open_model(d).build()
    assert plan_stages(m, refs, 2, (3, 1)) == [(0, 5), (5, 6)] and plan_stages(m, refs, 2) == [(0, 3), (3, 6)]
    p = _cli("logit-match", d, "--pp", "2", "--rank-weights", "3,1", "--reference", d / "reference.npz",
             cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pp2 vs np1" in p.stdout and " NO" not in p.stdout
    ids = tmp_path / "ids.npy"
    np.save(ids, np.load(d / "reference.npz")["ids"][:8])
    p = _cli("logits", d, "--tokens-file", ids, "--out", tmp_path / "o.npy", "--pp", "2", "--rank-weights", "3,1",
             cwd=tmp_path, timeout=300)
    assert p.returncode == 0 and "pp 2: layers [0, 5) [5, 6)" in p.stderr, p.stderr


def test_logits_and_bench_pp2(tmp_path):
    # `logits` in stages (chunks, then compiled decode steps) writes what np 1 writes;
    # `bench` counts the logits' all_sum as its plan says, and decodes compiled (not split)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 30))
    outs = {}
    for pp in (1, 2):
        outs[pp] = tmp_path / f"pp{pp}.npy"
        p = _cli("logits", FIXTURES / "gemma3/gqa_fp32", "--tokens-file", ids, "--out", outs[pp], "--pp", pp,
                 "--prefill-step", 7, "--decode-from", 20, "--backend", "ring", cwd=tmp_path, timeout=300)
        assert p.returncode == 0, p.stderr
    r = compare(np.load(outs[2]), np.load(outs[1]), rel_tol_for("float32"))
    assert r["ok"], r
    p = _cli("bench", "--pp", "2", "--prompt-tokens", 40, "--gen-tokens", 12, "--json", cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    b = json.loads(p.stdout)
    assert b["pp"] == 2 and b["np"] == 2 and b["gen_tokens"] == 12
    assert b["all_sums_per_token"] == b["all_sums_per_token_plan"] == 2  # the logits' and the agreement check's
    assert b["all_sum_bytes_per_token"] == b["all_sum_bytes_per_token_plan"]
    assert b["compiled"] and b["decode_graphs"] >= 1 and not b["split_decode"]


def test_a_stage_masks_its_own_layers():
    # gemma3/gqa_fp32 (sliding, sliding, full, sliding, sliding, full) at pp 4:
    # some stages hold one kind only, and a stage's full layer is not the first
    # full layer overall; each stage's caches and masks are its layers' kinds only.
    d = FIXTURES / "gemma3/gqa_fp32"
    kinds = model_args(read_config(d)).layer_types
    held = []
    for r in range(4):
        m = load_model(d, group=Group.planned(4, r), pp=4).model
        s = m.model.stage
        cache = m.make_cache()
        assert len(cache) == s.stop - s.start == len(m.layers)
        assert set(m.masks(40, cache)) == set(m.masks(1, None)) == set(kinds[s.start : s.stop])
        held.append(set(kinds[s.start : s.stop]))
    assert any(len(h) == 1 for h in held)  # the case this test is about


@pytest.mark.parametrize("name,P", [("gemma3n/mqa_untied_fp32", 2), ("gemma4/dense_fp32", 3),
                                    ("recurrent_gemma/mqa_fp32", 4)])
def test_stages_chained_in_one_process_give_the_stack_output(name, P):
    """Each stage's model (a planned group: no collective) with its sends fed
    to the next stage's receives in this process: every receive gets the
    shape and dtype the previous stage sent, as wide as the model's
    `stage_send_width` (plan's sends), and the last stage's final hidden
    states equal the whole stack's, over a chunked prompt and decode steps
    on each stage's own caches (shared KV, sliding, recurrent)."""
    import mlx.core as mx

    d = FIXTURES / name
    ids = mx.array(np.load(_reference(d))["ids"][None, :9].astype(np.int32))
    whole = load_model(d).model
    stages = [load_model(d, group=Group.planned(P, r), pp=P).model for r in range(P)]
    wire = []

    def send(stage, model):
        def send_tensor(x):
            assert x.shape[-1] == model.stage_send_width(stage.stop), (stage, x.shape)
            wire.append(x)
            return x
        return send_tensor

    def receive_tensor(shape, dtype):
        x = wire.pop()
        assert (tuple(x.shape), x.dtype) == (tuple(shape), dtype)
        return x

    for m in stages:
        m.model.stage.send_tensor = send(m.model.stage, m)
        m.model.stage.receive_tensor = receive_tensor
    caches = [m.make_cache() for m in stages]
    cache = whole.make_cache()
    for a, b in ((0, 6), (6, 7), (7, 8), (8, 9)):  # a chunk, then one token at a time
        want = whole.model(ids[:, a:b], cache)
        for m, c in zip(stages, caches):
            got = m.model(ids[:, a:b], c)
        assert not wire
        np.testing.assert_array_equal(np.array(got), np.array(want))
