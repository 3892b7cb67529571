"""`plan` from the headers alone: every rank's share partitions the model,
its bytes are the slices it would read, and a placement that does not fit
is refused naming the rank."""

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxcel_dist.cli import app
from mlxcel_dist.errors import UserError
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model, open_model
from mlxcel_dist.plan import format_plan, make_plan


def _covers(spans, total):
    spans = sorted(spans)
    return spans[0][0] == 0 and spans[-1][1] == total and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("n,weights", [(1, None), (2, None), (3, None), (4, None), (3, (3, 1, 1))])
def test_shares_partition_the_model(n, weights):
    ck = open_model(None)
    p = make_plan(ck, n, weights, bandwidth=5e9)
    one = make_plan(ck, 1, bandwidth=5e9)["ranks"][0].bytes
    ranks = p["ranks"]
    assert len(ranks) == n
    if n > 1:
        assert _covers([r.heads[:2] for r in ranks], 4)  # 4 q heads, each on one rank
        assert _covers([r.columns for r in ranks], 384)  # MLP intermediate
        assert _covers([r.vocab for r in ranks], 512)  # the head's rows
        assert all(r.bytes < one for r in ranks) and sum(r.bytes for r in ranks) > one  # norms, embedding replicated
        calls = p["collectives"]["all_sum"][0]
        assert calls == 2 * 4 + 1 and p["collectives"]["all_gather"][0] == 1  # o/down per layer, the check, the head
        assert p["comm_s"] > 0
    else:
        assert ranks[0].bytes == sum(ck.tensor_bytes().values()) and p["comm_s"] == 0
    if weights:
        assert ranks[0].columns[1] - ranks[0].columns[0] > ranks[1].columns[1] - ranks[1].columns[0]


def test_bytes_are_what_a_rank_loads():
    from mlx.utils import tree_flatten

    from mlxcel_dist.parallel.collectives import Group

    ck = open_model(default_model_dir())
    p = make_plan(ck, 1, bandwidth=5e9)
    m = load_model(ck).model
    assert p["ranks"][0].bytes == sum(v.nbytes for _, v in tree_flatten(m.parameters()))
    assert Group.planned(2, 0).size() == 2


def test_a_placement_that_does_not_fit_is_refused():
    with pytest.raises(UserError, match="rank 1 needs .* more than its"):
        make_plan(open_model(None), 2, memory=[10**9, 1000], bandwidth=5e9)


def test_cli():
    r = CliRunner().invoke(app, ["plan", "--np", "3", "--bandwidth", "5"])
    assert r.exit_code == 0, r.output
    assert "predicted decode" in r.output and sum(x.endswith(" MB") for x in r.output.splitlines()) == 3
    r = CliRunner().invoke(app, ["plan", "--np", "5"])
    assert r.exit_code == 2 and "cannot split 4 attention heads" in r.output
    r = CliRunner().invoke(app, ["plan", "--link", "carrier-pigeon"])
    assert r.exit_code == 2 and "--link must be one of" in r.output


def test_hostfile_memory_sets_the_shares_and_the_limit(tmp_path):
    """Three hosts of different memory=: without weights, each rank's share
    follows its memory; a host too small for its share is refused."""
    from fractions import Fraction

    from mlxcel_dist.cluster.hostfile import rank_memory, rank_weights, read_hostfile

    hf = tmp_path / "three.txt"
    hf.write_text("mac1 memory=192GB\nmac2 memory=64GB\nmac3 slots=2 memory=64GB\n")
    hosts = read_hostfile(hf).hosts
    assert rank_weights(hosts, 4) == (Fraction(6), Fraction(2), Fraction(1), Fraction(1))
    assert rank_memory(hosts, 4) == [192 * 10**9, 64 * 10**9, 32 * 10**9, 32 * 10**9]
    r = CliRunner().invoke(app, ["plan", "--hostfile", str(hf), "--bandwidth", "5"])
    assert r.exit_code == 0, r.output
    cols = [r.columns for r in make_plan(open_model(None), 4, rank_weights(hosts, 4), bandwidth=5e9)["ranks"]]
    widths = [b - a for a, b in cols]
    assert widths[0] > widths[1] > widths[2] == widths[3], widths  # 6 : 2 : 1 : 1, in whole columns
    small = tmp_path / "small.json"
    small.write_text('[{"ssh": "mac1", "memory": "1MB"}, {"ssh": "mac2", "memory": "1MB"}]')
    r = CliRunner().invoke(app, ["plan", "--hostfile", str(small)])
    assert r.exit_code == 2 and "rank 0 needs" in r.output and "of memory" in r.output, r.output


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_stages(pp):
    """--pp: each rank's layers (contiguous, every layer once) and the bytes
    of exactly what its stage loads (the loader's own cut)."""
    ck = open_model(None)
    p = make_plan(ck, pp, pp=pp, bandwidth=5e9)
    layers = [r.layers for r in p["ranks"]]
    assert _covers(layers, 4) and all(b > a for a, b in layers)
    total = sum(ck.tensor_bytes().values())
    assert all(r.bytes < total for r in p["ranks"])
    assert sum(r.bytes for r in p["ranks"]) >= total  # a tied head: the last stage holds the embedding too
    assert p["collectives"]["send"][0] == pp - 1
    r = CliRunner().invoke(app, ["plan", "--pp", str(pp), "--bandwidth", "5"])
    assert r.exit_code == 0 and f"in {pp} pipeline stages" in r.output, r.output


def test_pipeline_stages_with_tensor_parallel_inside():
    """--np 6 --pp 2: each stage's 3 ranks hold its layers and split its
    heads as --np 3 does (uneven); what they load matches the loader's own
    per-rank load; the all_sums inside the stages are chains of messages."""
    from mlx.utils import tree_flatten

    from mlxcel_dist.checkpoint import weights
    from mlxcel_dist.parallel.collectives import Group
    from mlxcel_dist.checkpoint.loader import load_model
    from reference_cases import FIXTURES

    d = FIXTURES / "llama/gqa_fp32"
    p = make_plan(open_model(d), 6, pp=2, bandwidth=5e9)
    tp = make_plan(open_model(d), 3, bandwidth=5e9)
    assert [r.layers for r in p["ranks"]] == [(0, 3)] * 3 + [(3, 6)] * 3
    assert [r.heads for r in p["ranks"]] == [r.heads for r in tp["ranks"]] * 2
    for r in (0, 4):
        before = weights.bytes_read
        m = load_model(d, group=Group.planned(6, r), pp=2).model
        assert weights.bytes_read - before == p["ranks"][r].bytes
        assert {n for n, _ in tree_flatten(m.parameters()) if n.startswith("model.layers.")}
    calls, _ = p["collectives"]["p2p inside stages"]
    assert calls == 2 * 2 * (3 - 1) * 6  # 2 all_sums a layer, 6 layers, 2 (T - 1) messages each
    r = CliRunner().invoke(app, ["plan", str(d), "--np", "6", "--pp", "2", "--bandwidth", "5"])
    assert r.exit_code == 0 and "2 pipeline stages (3 tensor-parallel ranks each)" in r.output, r.output


def test_stages_follow_the_rank_weights_and_the_hosts_memory(tmp_path):
    """--pp with rank weights (or a hostfile's memory=): each stage's layer
    bytes follow its ranks' weights; inside a stage (--np P x T) the heads
    split by the members' weights; what a rank loads is what plan says."""
    from fractions import Fraction

    from mlxcel_dist.checkpoint import weights
    from mlxcel_dist.parallel.collectives import Group
    from mlxcel_dist.checkpoint.loader import load_model
    from reference_cases import FIXTURES

    d = FIXTURES / "llama/gqa_fp32"  # 6 equal layers, untied head
    even = [r.layers for r in make_plan(open_model(d), 2, pp=2, bandwidth=5e9)["ranks"]]
    heavy = [r.layers for r in make_plan(open_model(d), 2, (Fraction(3), Fraction(1)), pp=2, bandwidth=5e9)["ranks"]]
    assert heavy[0][1] - heavy[0][0] > even[0][1] - even[0][0], (even, heavy)  # stage 0 takes more layers
    hf = tmp_path / "three.txt"
    hf.write_text("mac1 memory=192GB\nmac2 memory=64GB\nmac3 memory=32GB\n")
    r = CliRunner().invoke(app, ["plan", str(d), "--hostfile", str(hf), "--pp", "3", "--bandwidth", "5"])
    assert r.exit_code == 0 and "by parameter bytes / rank weights" in r.output, r.output
    p = make_plan(open_model(d), 3, (Fraction(6), Fraction(2), Fraction(1)), pp=3, bandwidth=5e9)
    spans = [b - a for a, b in (rp.layers for rp in p["ranks"])]
    assert spans[0] > spans[1] >= spans[2] and sum(spans) == 6, spans
    w = (Fraction(2), Fraction(1), Fraction(1), Fraction(1))  # stage 0 (ranks 0, 1) weighs 3, stage 1 weighs 2
    p = make_plan(open_model(d), 4, w, pp=2, bandwidth=5e9)
    tp = make_plan(open_model(d), 2, w[:2], bandwidth=5e9)
    assert [rp.heads for rp in p["ranks"][:2]] == [rp.heads for rp in tp["ranks"]]  # 2:1 inside stage 0
    for r in (0, 3):
        before = weights.bytes_read
        load_model(d, group=Group.planned(4, r, w), pp=2)
        assert weights.bytes_read - before == p["ranks"][r].bytes


def test_pipeline_refusals():
    from reference_cases import FIXTURES

    r = CliRunner().invoke(app, ["plan", "--pp", "5"])
    assert r.exit_code == 2 and "needs at least 5 layers" in r.output, r.output
    r = CliRunner().invoke(app, ["plan", str(FIXTURES / "diffusion_gemma/kv4_fp32"), "--pp", "2"])
    assert r.exit_code == 2 and "cannot run in pipeline stages" in r.output, r.output
    # shared KV stays on its source's stage: gemma3n/gqa_fp32 can be cut only before layer 1
    r = CliRunner().invoke(app, ["plan", str(FIXTURES / "gemma3n/gqa_fp32"), "--pp", "3"])
    assert r.exit_code == 2 and "at most --pp 2" in r.output, r.output


def test_pipeline_sends_what_the_stages_hand_on():
    """gemma3n's stages send the AltUp streams and the later layers'
    per-layer inputs, gemma4's the hidden state and those inputs."""
    from reference_cases import FIXTURES

    for name, pp, width in (("gemma3n/gqa_fp32", 2, 4 * 32 + 5 * 16), ("gemma4/dense_fp32", 3, 32 + 5 * 8 + 32 + 4 * 8),
                            ("recurrent_gemma/mqa_fp32", 2, None)):
        ck = open_model(FIXTURES / name)
        p = make_plan(ck, pp, pp=pp, bandwidth=5e9)
        width = width or (pp - 1) * int(ck.args.hidden_size)
        assert p["collectives"]["send"] == (pp - 1, width * 4), (name, p["collectives"])  # fp32


def _every_case():
    from reference_cases import FIXTURES

    return sorted(d.parent for d in FIXTURES.glob("*/*/config.json"))


@pytest.mark.parametrize("d", _every_case(), ids=lambda d: f"{d.parent.name}/{d.name}")
def test_every_case_plans_at_np2(d):
    """plan on paper for every fixture case (a family's own tensor views, e.g.
    step3p5's row ranges, included): each rank holds less than the whole."""
    ck = open_model(d)
    one = make_plan(ck, 1, bandwidth=5e9)["ranks"][0].bytes
    p = make_plan(ck, 2, bandwidth=5e9)
    assert all(0 < r.bytes < one for r in p["ranks"]) and p["collectives"]["all_sum"][0] > 0


# a decoded token's reads (issue 41) ------------------------------------------------
def test_a_token_reads_top_k_of_the_experts_and_one_embedding_row():
    """qwen3_moe/gqa_fp32 (8 experts, top-2; layer 1 dense): a token reads
    each routed expert's bytes times k / E, one row of the embedding, all
    the rest (the head, attention, the router, the dense layer), the same
    whether the experts split by intermediate or by whole experts."""
    from reference_cases import FIXTURES

    ck = open_model(FIXTURES / "qwen3_moe/gqa_fp32")
    a = ck.args
    want = 0.0
    for name, b in ck.tensor_bytes().items():
        share = (a.num_experts_per_tok / a.num_experts if ".mlp.experts." in name
                 else 1 / a.vocab_size if name == "model.embed_tokens.weight" else 1.0)
        want += b * share
    one = make_plan(ck, 1, bandwidth=5e9, host_token=0.0, host_layer=0.0)["ranks"][0]
    assert one.reads == int(want) and one.reads < one.bytes / 2
    for split in ("intermediate", "experts"):
        two = make_plan(ck, 2, bandwidth=5e9, moe_split=split, host_token=0.0, host_layer=0.0)["ranks"]
        assert all(r.reads < r.bytes for r in two)
        # the two ranks' reads together: the one rank's, plus what both hold (norms, router, dense layer...)
        both = sum(r.bytes for r in two) - one.bytes
        assert one.reads < sum(r.reads for r in two) <= one.reads + both, split
    p = make_plan(ck, 1, bandwidth=1e9, host_token=0.0, host_layer=0.0)
    assert p["token_s"] == pytest.approx(one.reads / 1e9)  # the time is the reads', not the bytes held


def test_the_cache_a_token_reads_over_the_context():
    """--context C: a full layer reads 2 x C x kv heads x head_dim, a sliding
    one at most its window; latent attention (deepseek_v3) its latent cache,
    C x (kv_lora_rank + rope dim) a layer."""
    from reference_cases import FIXTURES

    ck = open_model(FIXTURES / "gemma3/gqa_fp32")  # window 16, 2 full + 4 sliding layers, 2 kv heads x 16
    for C, want in ((10, 6 * 2 * 10 * 2 * 16 * 4), (100, (2 * 100 + 4 * 16) * 2 * 2 * 16 * 4)):
        assert make_plan(ck, 1, bandwidth=5e9, host_token=0.0, host_layer=0.0, context=C)["ranks"][0].cache_reads == want
    ck = open_model(FIXTURES / "deepseek_v3/yarn_fp32")
    a = ck.args
    got = make_plan(ck, 1, bandwidth=5e9, host_token=0.0, host_layer=0.0, context=50)["ranks"][0].cache_reads
    assert got == a.num_hidden_layers * 50 * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    assert make_plan(ck, 1, bandwidth=5e9, host_token=0.0, host_layer=0.0)["ranks"][0].cache_reads == 0
    with pytest.raises(UserError, match="--context must be >= 0"):
        make_plan(ck, 1, bandwidth=5e9, host_token=0.0, host_layer=0.0, context=-1)


def test_qwen3_235b_from_its_headers(tmp_path):
    """Qwen3-235B-A22B (its real config, a header-only checkpoint): 8-bit it
    holds 250 GB and a token reads about 22 active billion parameters' bytes
    (22.9 GB at 8.5 bits); with --pp 2 each stage shows its time; the
    bytes-only prediction for the published setups (docs/benchmarks.md)."""
    sys.path[:0] = [str(Path(__file__).parent / "helpers"), str(Path(__file__).parent.parent / "benchmarks")]
    from header_ckpt import write_header_only
    from moe_plan import QWEN3_235B

    ck = open_model(write_header_only(tmp_path / "q8", QWEN3_235B, {"group_size": 64, "bits": 8}))
    assert 245e9 < sum(ck.tensor_bytes().values()) < 255e9
    p = make_plan(ck, 2, pp=2, link="tb5", bandwidth=819e9, memory=[512e9] * 2, host_token=0.0, host_layer=0.0)
    reads = sum(st["reads"] for st in p["stages"])
    assert 22e9 < reads < 24e9, reads
    assert p["token_s"] == pytest.approx(reads / 819e9 + p["comm_s"])
    lines = format_plan(p)
    assert sum(line.startswith("stage ") for line in lines) == 2 and "given" in lines[-1]
    tp = make_plan(ck, 4, (1, 1, 1, 1), link="tb5", bandwidth=819e9, memory=[512e9] * 4, host_token=0.0,
                   host_layer=250e-6)
    assert tp["token_s"] == pytest.approx(max(r.reads for r in tp["ranks"]) / 819e9 + 94 * 250e-6 + tp["comm_s"])


def test_m3_ultra_hostfile_from_public_runs(tmp_path):
    """hostfiles/four-m3-ultras-tb5.txt's host_us_per_layer= is the derivation
    benchmarks/moe_plan.py makes from a public M3 Ultra run (Qwen3-0.6B-4bit,
    819 GB/s): (1 / tok/s - reads / bandwidth) / (layers x kernel ratio) x a
    Qwen3-MoE layer's kernel ratio; its four ranks weigh 1 each."""
    sys.path[:0] = [str(Path(__file__).parent / "helpers"), str(Path(__file__).parent.parent / "benchmarks")]
    from mlxcel_dist.cluster.hostfile import rank_host_layer, rank_weights, read_hostfile
    from moe_plan import M3_ULTRA_BW, QWEN3_235B, depth_ratio, m3_ultra_host

    bw, h = m3_ultra_host(tmp_path)["given"]
    assert bw == M3_ULTRA_BW and 60e-6 < h < 80e-6, h
    layer = h * depth_ratio(QWEN3_235B, {"group_size": 64, "bits": 8}, tmp_path)
    hosts = read_hostfile(Path(__file__).parent.parent / "hostfiles" / "four-m3-ultras-tb5.txt").hosts
    assert rank_host_layer(hosts, 4) == pytest.approx([layer] * 4, abs=0.5e-6)
    assert list(rank_weights(hosts, 4)) == [1, 1, 1, 1]


def test_hosts_own_host_time(tmp_path):
    """A hostfile's host_us_per_layer= is its ranks' (the slowest one's
    counts in a stage); --host-us-per-layer is every rank's; a bad value is
    one line."""
    from mlxcel_dist.cluster.hostfile import rank_host_layer, read_hostfile
    from reference_cases import FIXTURES

    hf = tmp_path / "h.txt"
    hf.write_text("a host_us_per_layer=100 memory=64GB\nb host_us_per_layer=400 memory=64GB\n")
    assert rank_host_layer(read_hostfile(hf).hosts, 2) == pytest.approx([100e-6, 400e-6])
    d = FIXTURES / "llama/gqa_fp32"  # 6 layers, 3 a stage
    r = CliRunner().invoke(app, ["plan", str(d), "--hostfile", str(hf), "--pp", "2", "--bandwidth", "5",
                                 "--host-ms-per-token", "0"])
    assert r.exit_code == 0, r.output
    stages = [line for line in r.output.splitlines() if line.startswith("stage ")]
    assert len(stages) == 2 and "host 0.30 ms" in stages[0] and "host 1.20 ms" in stages[1], stages
    assert "400 us a layer (the slowest rank's), given" in r.output
    r = CliRunner().invoke(app, ["plan", str(d), "--np", "2", "--bandwidth", "5", "--host-us-per-layer", "50",
                                 "--host-ms-per-token", "1", "--context", "64"])
    assert r.exit_code == 0 and "1.00 ms a token, given, + 50 us a layer" in r.output, r.output
    assert "at --context 64" in r.output
    hf.write_text("a host_us_per_layer=fast\n")
    r = CliRunner().invoke(app, ["plan", str(d), "--hostfile", str(hf)])
    assert r.exit_code == 2 and "host_us_per_layer must be a number" in r.output, r.output


def test_the_measured_layer_host_time_follows_the_layer_kernels():
    """The host time a layer is measured on a tiny llama and scaled by the
    model's decode primitives a layer against that llama's (a built graph,
    never run): about 1 for llama, more for MoE and latent attention."""
    from mlxcel_dist.plan import decode_primitives, layer_kernel_ratio
    from reference_cases import FIXTURES

    assert layer_kernel_ratio(open_model(FIXTURES / "llama/gqa_fp32")) == pytest.approx(1.0, abs=0.1)
    moe = layer_kernel_ratio(open_model(FIXTURES / "qwen3_moe/gqa_fp32"))
    mla = layer_kernel_ratio(open_model(FIXTURES / "deepseek_v3/yarn_fp32"))
    assert 1.1 < moe < mla, (moe, mla)
    m, _ = open_model(FIXTURES / "qwen3_moe/gqa_fp32").build()
    assert decode_primitives(m) == decode_primitives(open_model(FIXTURES / "qwen3_moe/gqa_fp32").build()[0]) > 0
    p = make_plan(open_model(FIXTURES / "qwen3_moe/gqa_fp32"), 1, bandwidth=5e9, host_token=0.0)
    assert p["layer_ratio"] == moe
    assert "a llama layer's (split steps, as this model decodes) x" in format_plan(p)[-1]
    # the llama baseline is timed with the step kind the planned model decodes with (decode.splittable):
    # llama and qwen3_moe split their steps around attention, deepseek_v3 (latent attention) and any
    # pipeline stage run one graph a step
    llama = open_model(FIXTURES / "llama/gqa_fp32")
    kw = dict(bandwidth=5e9, host_token=0.0)
    assert [make_plan(ck, n, pp=pp, **kw)["split_step"] for ck, n, pp in
            ((llama, 1, 1), (llama, 2, 1), (llama, 2, 2), (open_model(FIXTURES / "qwen3_moe/gqa_fp32"), 2, 1),
             (open_model(FIXTURES / "deepseek_v3/yarn_fp32"), 1, 1))] == [True, True, False, True, False]


@pytest.mark.parametrize("backend,requested,n,pp,route", [
    ("ring", "auto", 3, 3, "send"), ("ring", "collective", 3, 3, "job"), ("nccl", "auto", 3, 3, "job"),
    ("mpi", "collective", 4, 2, "split"), ("mpi", "auto", 4, 2, "send"),
])
def test_plan_hands_on_as_the_launch_would(backend, requested, n, pp, route):
    """--pp: the hand-offs are what a launch on that backend would use
    (pipeline.handoff_mode): sends, or all_gathers (collectives.HandOff)
    over the whole job (nccl; ring under --pp-handoff collective) or each
    hop's split group with all_sums inside the stages (mpi, collective).
    Whole-job hops are counted as a rank's model counts them (what bench
    holds a run to); their time is a ring all_gather's n - 1 steps."""
    from mlxcel_dist.parallel.collectives import Group, HandOff
    from mlxcel_dist.plan import HANDOFF_OP, LINKS
    from reference_cases import FIXTURES

    ck = open_model(FIXTURES / "gemma4/dense_fp32")  # the hand-off's width changes from stage to stage
    kw = dict(pp=pp, bandwidth=5e9, host_token=0.0, host_layer=0.0)
    sent = make_plan(ck, n, **kw)  # on paper: send/recv
    p = make_plan(ck, n, backend=backend, pp_handoff=requested, **kw)
    line = next(x for x in format_plan(p) if x.startswith("pipeline hand-offs"))
    assert f"backend {backend}" in line, line
    if route == "send":
        assert p["collectives"] == sent["collectives"] and p["comm_s"] == sent["comm_s"] and "send/recv" in line
        return
    hops, nbytes = p["collectives"][HANDOFF_OP]
    assert "send" not in p["collectives"] and (hops, nbytes) == sent["collectives"]["send"]
    lat, bw = LINKS["loopback"][:2]
    if route == "job":
        assert "over the whole job" in line
        for r in range(n):  # every rank takes part in every hop: its model counts each as plan does
            m = load_model(FIXTURES / "gemma4/dense_fp32", group=Group.planned(n, r), pp=pp).model
            stage = m.model.stage
            stage.handoff = HandOff(Group.planned(n, r), pp, 1, [m.stage_send_width(e) for _, e in stage.ranges[:-1]],
                                    split=False)
            assert m.collectives_per_token()["all_gather"] == (hops, nbytes), r
        # each hop a ring all_gather over the job's n ranks: n - 1 steps of its width, where a send is one
        assert p["comm_s"] - sent["comm_s"] == pytest.approx((n - 2) * (hops * lat + nbytes / bw))
    else:
        assert "over each hop's ranks" in line and "all_sums over its split group" in line
        T = n // pp
        chains = sent["collectives"]["p2p inside stages"]
        assert "p2p inside stages" not in p["collectives"]
        assert p["collectives"]["all_sum inside stages"] == (chains[0] // (2 * (T - 1)), chains[1] // (2 * (T - 1)))


def test_plan_cli_takes_the_launch_backend_and_handoff():
    r = CliRunner().invoke(app, ["plan", "--pp", "2", "--backend", "nccl", "--bandwidth", "5"])
    assert r.exit_code == 0 and "an all_gather over the whole job" in r.output and "(hand-off)" in r.output, r.output
    r = CliRunner().invoke(app, ["plan", "--pp", "2", "--backend", "ring", "--bandwidth", "5"])
    assert r.exit_code == 0 and "pipeline hand-offs: send/recv (backend ring, --pp-handoff auto)" in r.output, r.output
    for argv, want in ((["--np", "4", "--pp", "2", "--backend", "nccl"], "error: --np 4 --pp 2 on backend nccl"),
                       (["--pp", "2", "--backend", "nccl", "--pp-handoff", "send"],
                        "error: --pp-handoff send: backend nccl"),
                       (["--pp", "2", "--backend", "carrier"], "error: unknown backend 'carrier'")):
        r = CliRunner().invoke(app, ["plan", *argv, "--bandwidth", "5"])
        assert r.exit_code == 2 and r.output.startswith(want) and len(r.output.splitlines()) == 1, r.output


def _routed_share(a) -> float:
    k = a.num_experts_per_tok
    E = next(getattr(a, n) for n in ("n_routed_experts", "num_local_experts", "num_experts") if getattr(a, n, None))
    return k / E


@pytest.mark.parametrize("case", ["deepseek_v3/yarn_fp32", "glm4_moe/gqa_fp32", "exaone_moe/gqa_fp32",
                                  "qwen3_5_moe/text_fp32", "llama4/gqa_fp32", "gpt_oss/gqa_fp32"])
def test_a_token_reads_shared_experts_and_attention_whole(case):
    """From the checkpoint's own tensor table: a routed expert's bytes
    (`.experts.`, stored one by one or as a stack, biases too) count k / E,
    the embedding one row of its rows (all of it where it is also the head:
    qwen3_5_moe's is tied), everything else whole: shared experts, dense
    layers, the router and its bias, attention, norms, the head. np 1, no
    context."""
    from reference_cases import FIXTURES

    ck = open_model(FIXTURES / case)
    a = ck.args
    routed = _routed_share(a)
    row = 1.0 if getattr(a, "tie_word_embeddings", False) else 1 / a.vocab_size
    want = 0.0
    for name, b in ck.tensor_bytes().items():
        share = routed if ".experts." in name else row if name.endswith("embed_tokens.weight") else 1.0
        want += b * share
    got = make_plan(ck, 1, bandwidth=5e9, host_token=0.0, host_layer=0.0)["ranks"][0].reads
    assert got == pytest.approx(want, abs=1), case


def test_whole_experts_per_rank_wait_for_the_busiest():
    """--moe-split experts: a layer's all_sum waits for the rank that got
    the most of the token's k experts, so the step reads, on its slowest
    rank, the expected largest share (multivariate hypergeometric over the
    ranks' held experts), not k x held / E. qwen3_moe/gqa_fp32 (8 experts,
    top-2) at np 2, 4 a rank: both on one rank with chance 2 C(4,2) / C(8,2)
    = 3/7, so the busiest reads 1 + 3/7 experts a layer against 1 on average;
    the intermediate split (every rank reads all k) is unchanged."""
    from reference_cases import FIXTURES

    from mlxcel_dist.plan import expected_busiest

    assert expected_busiest(2, (4, 4), (1.0, 1.0)) == pytest.approx(10 / 7)
    assert expected_busiest(2, (8,), (3.0,)) == pytest.approx(6.0)  # one rank: all k, each 3 bytes
    assert expected_busiest(1, (1, 3), (1.0, 1.0)) == pytest.approx(1.0)  # one expert: one rank reads it
    assert expected_busiest(3, (1, 1, 1), (1.0, 2.0, 4.0)) == pytest.approx(4.0)  # all three drawn
    ck = open_model(FIXTURES / "qwen3_moe/gqa_fp32")
    per_expert = sum(b for n, b in ck.tensor_bytes().items() if ".mlp.experts.0." in n)  # one expert, every layer
    kw = dict(bandwidth=5e9, host_token=0.0, host_layer=0.0)
    inter = make_plan(ck, 2, moe_split="intermediate", **kw)
    assert inter["stages"][0]["reads"] == max(r.reads for r in inter["ranks"])
    whole = make_plan(ck, 2, moe_split="experts", **kw)
    mean = max(r.reads for r in whole["ranks"])
    assert whole["stages"][0]["reads"] == pytest.approx(mean + 3 / 7 * per_expert)
    assert whole["token_s"] == pytest.approx(whole["stages"][0]["reads"] / 5e9 + whole["comm_s"])
    assert any("waits for the rank that got the most" in line for line in format_plan(whole))
