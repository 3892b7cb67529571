"""Tensor parallelism under the real launcher: N processes over ring and MPI,
every case at np 2 and every family at np 3 and 4, every mode, against the
transformers reference and against the single-process run."""

import sys
from pathlib import Path

import numpy as np
import pytest

from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import rel_tol_for
from mlxcel_dist.cluster.launcher import launch
from mlxcel_dist.checkpoint.loader import check_shardable

from reference_cases import (FIXTURES, assert_modes_match, case_id, cases, launched_results, short_length_of,
                             single_process_logits, window_of)
from testproc import run_cmd

HELPER = Path(__file__).parent / "helpers" / "tp_cases.py"
CASES = cases()
BACKENDS = ["mpi", "ring"]


def _shardable(d, n):
    try:
        check_shardable(d, n)
        return True
    except UserError:
        return False


def test_every_case_runs_at_np2_np3_and_np4():
    # The fixtures are built so that every family is tested at np 2 and 4;
    # every case also splits unevenly at np 3 (partition.head_partition).
    assert [case_id(d) for d in CASES if not all(_shardable(d, n) for n in (2, 3, 4))] == []


def test_impossible_counts_are_refused_before_launch():
    d = FIXTURES / "llama" / "mqa_tied_fp32"  # 4 q heads
    with pytest.raises(UserError, match="5 ranks cannot split 4 attention heads"):
        check_shardable(d, 5)
    with pytest.raises(UserError, match="2 rank weights for 3 ranks"):
        check_shardable(d, 3, (1, 2))


def _tol(d):
    return rel_tol_for("bfloat16" if "bf16" in d.name else "float32")


@pytest.fixture(scope="module")
def single():
    return {d: single_process_logits(d) for d in CASES}


# MPI runs every case at np 2 and every family at np 3 and 4; the ring backend two gemma3 cases at
# np 2 (4 ring ranks on CI's 2 cores spin in their receives: ~50 CPU-seconds a case). The ring's
# 4-rank all_sum is the logits' of test_pipeline's pp 2 x tp 2 ring job (every family, decoding);
# KV heads replicated over 4 ranks are MPI's np 4 here, the same split and model code.
_RING2 = [d for d in cases("gemma3") if d.name in ("gqa_bf16", "softcap_fp32")]
_WEIGHTED = [(FIXTURES / "olmo3" / "gqa_fp32", "1,2,1")]


def _kv_heads(d) -> int:
    from mlxcel_dist.checkpoint.loader import model_args, read_config

    a = model_args(read_config(d))
    return int(getattr(a, "num_key_value_heads", None) or a.num_attention_heads)


def _per_family(most_kv: bool) -> list:
    """Per family its fp32 case with the most (or fewest) KV heads."""
    order = sorted(CASES, key=lambda d: ("fp32" in d.name, _kv_heads(d) if most_kv else -_kv_heads(d)))
    return list({d.parent.name: d for d in order}.values())


# np 4: per family its fp32 case with the fewest KV heads (each KV head on 2 or 4 ranks: the
# replicated split np 2 never makes); np 3 (uneven shares: 4 heads as 2, 1, 1; 8 heads with 2 KV
# heads as 3, 3, 2, the middle rank holding both KV heads, one of them twice): per family its fp32
# case with the most, plus one --rank-weights case; np 2: every case
_NP4 = _per_family(most_kv=False)
_NP3 = _per_family(most_kv=True)
RUNS = {("mpi", 2): CASES, ("mpi", 3): _NP3 + _WEIGHTED, ("mpi", 4): _NP4, ("ring", 2): _RING2}
# Every launch feeds harness.short_length tokens, which still cross the window twice in every mode
# (and feed each mode as the whole sequence does: their logits are compared with the single-process
# run's first rows too)
SHORT = set(RUNS)
COMBOS = [(b, n, d) for (b, n), ds in RUNS.items() for d in ds]


def _arg(d) -> str:
    """A case as tp_cases.py takes it: the directory, or DIR@WEIGHTS."""
    return f"{d[0]}@{d[1]}" if isinstance(d, tuple) else str(d)


def _name(d) -> str:
    return f"{d[0].parent.name}__{d[0].name}@{d[1]}" if isinstance(d, tuple) else f"{d.parent.name}__{d.name}"


def _id(d) -> str:
    return f"{case_id(d[0])}@{d[1]}" if isinstance(d, tuple) else case_id(d)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """One launch per (backend, np), all its cases in one job, run on first use."""
    return launched_results(tmp_path_factory, RUNS, str(HELPER), "tp", _arg, SHORT)


@pytest.mark.parametrize("backend,n,d", COMBOS, ids=[f"{b}-np{n}-{_id(d)}" for b, n, d in COMBOS])
def test_tp_matches_reference_and_single_process(tp_results, single, backend, n, d):
    out = tp_results(backend, n)
    name = _name(d)
    d = d[0] if isinstance(d, tuple) else d
    rows = short_length_of(d) if (backend, n) in SHORT else None
    assert_modes_match(out / f"{name}.npz", np.load(d / "reference.npz")["logits"], single[d], _tol(d), (backend, n),
                       rows, window_of(d))


def test_kv_head_counts_covered():
    # The matrix must include MQA (1 KV head) and GQA (2 KV heads) at np 4,
    # i.e. KV heads replicated across ranks.
    from mlxcel_dist.checkpoint.loader import model_args, read_config

    # as each family's ModelArgs reads them (config forms differ: text_config, hub keys)
    kv = {getattr(model_args(read_config(d)), "num_key_value_heads", None) for d in RUNS[("mpi", 4)]}
    assert {1, 2} <= kv
    assert {d.parent.name for d in RUNS[("mpi", 4)]} == {d.parent.name for d in CASES}  # every family at np 4


def test_logit_match_fails_on_a_wrong_shard(tmp_path):
    # A rank that loads the wrong KV heads (fault injected into the sharding)
    # must make the harness report a mismatch and exit 1.
    d = FIXTURES / "gemma3" / "gqa_fp32"
    env = dict(__import__("os").environ, MLXCEL_DIST_INJECT_FAULT="wrong-kv-slice")
    p = run_cmd(
        [sys.executable, "-m", "mlxcel_dist.cli", "logit-match", str(d), "--np", "2", "--backend", "mpi",
         "--reference", str(d / "reference.npz")],
        env=env, timeout=300, cwd=tmp_path,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "np2 vs np1" in p.stdout and "NO" in p.stdout
    # the single-process rows still match: only the sharded run is wrong
    assert all(line.endswith("yes") for line in p.stdout.splitlines() if "np1 vs reference" in line)


def test_logit_match_passes_on_default_model(tmp_path):
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", "--np", "2"],
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "np2 vs np1" in p.stdout and " NO" not in p.stdout


def test_each_rank_reads_only_its_shard(tmp_path):
    # gqa_fp32: everything but embeddings and norms is split 2 ways (8 q heads,
    # 2 KV heads, MLP columns), so each rank reads and holds exactly
    # replicated + sharded / 2 bytes, never the whole checkpoint.
    from mlxcel_dist.checkpoint.weights import open_checkpoint

    d = FIXTURES / "gemma3" / "gqa_fp32"
    refs = open_checkpoint(d)
    total = sum(int(np.prod(r.shape)) * 4 for r in refs.values())
    sharded = sum(int(np.prod(r.shape)) * 4 for n, r in refs.items() if "_proj" in n)
    expected = total - sharded + sharded // 2
    code = launch([str(d), str(tmp_path)], 2, "mpi", script=str(Path(__file__).parent / "helpers" / "rank_bytes.py"))
    assert code == 0
    import json

    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["read"] == expected and got["held"] == expected, (got, expected, total)


def test_logit_match_uneven_with_rank_weights(tmp_path):
    # --rank-weights reaches every rank through its argv: 3 ranks at 3:1:1 on
    # the default model (4 heads as 2, 1, 1; MLP columns and vocabulary 3:1:1).
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "logit-match", "--np", "3", "--rank-weights", "3,1,1"],
                timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "np3 vs np1" in p.stdout and " NO" not in p.stdout
