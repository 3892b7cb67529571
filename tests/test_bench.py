"""`mlxcel-dist bench`: one JSON line with positive numbers at np 1 and np 2,
and the collectives it counts per decoded token equal what the sharding plan
predicts (all_sums: o/down projections, OLMo 3's q/k norm statistic, MoE
blocks, the rank-agreement check; all_gather: the vocabulary-split head).
No timing assertions."""

import json
import sys

import pytest
from typer.testing import CliRunner

from mlxcel_dist.cli import app

from reference_cases import FIXTURES
from testproc import run_cmd

runner = CliRunner()
KEYS = ("prefill_tok_s", "decode_tok_s", "ttft_s", "peak_mem_gb")
SMALL = ["--prompt-tokens", "24", "--gen-tokens", "6"]


def one_json_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


def check_numbers(r: dict, np_: int) -> None:
    for k in KEYS:
        assert isinstance(r[k], float) and r[k] > 0, (k, r[k])
    assert r["np"] == np_ and len(r["peak_mem_gb_per_rank"]) == np_
    assert r["peak_mem_gb"] == max(r["peak_mem_gb_per_rank"])
    assert r["gen_tokens"] == 6
    # one single-token step per generated id (4 in the warm-up): a compiled
    # step's graph is built once and replayed, an eager one's every step
    assert r["decode_graphs"] == (1 if r["compiled"] else 4 + 6)


def bench_np2(*args, timeout=120) -> dict:
    p = run_cmd([sys.executable, "-m", "mlxcel_dist.cli", "bench", *map(str, args), "--np", "2", "--json", *SMALL],
                timeout=timeout)
    assert p.returncode == 0, p.stderr
    return one_json_line(p.stdout)


def test_bench_json_np1_default_model():
    r = runner.invoke(app, ["bench", "--json", *SMALL])
    assert r.exit_code == 0, r.output
    res = one_json_line(r.stdout)
    check_numbers(res, 1)
    assert res["all_sums_per_token"] == res["all_sums_per_token_plan"] == 0
    assert res["model"].endswith("gemma3-tiny")


def test_bench_table_and_bad_input():
    r = runner.invoke(app, ["bench", "--prompt-tokens", "4", "--gen-tokens", "2", "--no-warmup"])
    assert r.exit_code == 0, r.output
    assert "decode" in r.stdout and "tok/s" in r.stdout and "peak memory" in r.stdout
    r = runner.invoke(app, ["bench", "--gen-tokens", "0"])
    assert r.exit_code == 2 and "--gen-tokens must be >= 1" in r.output


@pytest.mark.parametrize("mode", ["--compile", "--no-compile"])
def test_bench_json_np2_counts_the_plan(mode):
    # gemma3-tiny: 4 layers, hidden 128, float32: o_proj + down_proj per
    # layer ([1, 1, 128] float32 each) + the per-token agreement check ([2, 3] int32).
    # Eager steps are counted as they run; a compiled one when its graph is built.
    r = bench_np2(mode)
    check_numbers(r, 2)
    assert r["compiled"] == (mode == "--compile")
    assert r["all_sums_per_token"] == r["all_sums_per_token_plan"] == 4 * 2 + 1
    assert r["all_sum_bytes_per_token"] == r["all_sum_bytes_per_token_plan"] == 8 * 128 * 4 + 2 * 3 * 4
    assert r["agreement_checks"] == 6 and r["end_all_sums"] == 0
    # the output head split by vocabulary (512 / 2 rows): one all_gather of [256, 1] float32
    assert r["all_gathers_per_token"] == r["all_gathers_per_token_plan"] == 1
    assert r["all_gather_bytes_per_token"] == r["all_gather_bytes_per_token_plan"] == 256 * 4


@pytest.mark.parametrize("case,extra,calls", [
    # olmo3, 6 layers: + one q/k norm statistic per layer; no per-token check
    ("olmo3/gqa_fp32", ["--check-every", "0"], 6 * 3),
    # gpt_oss, 4 layers: attention + one all_sum per MoE block; check every token
    ("gpt_oss/gqa_fp32", [], 4 * 2 + 1),
])
def test_all_sums_per_token_match_the_sharding_plan(case, extra, calls):
    r = bench_np2(FIXTURES / case, *extra, "--no-warmup")
    assert r["all_sums_per_token"] == r["all_sums_per_token_plan"] == calls
    assert r["all_sum_bytes_per_token"] == r["all_sum_bytes_per_token_plan"]
    assert r["all_gathers_per_token"] == r["all_gathers_per_token_plan"] == 1
    assert r["all_gather_bytes_per_token"] == r["all_gather_bytes_per_token_plan"]
