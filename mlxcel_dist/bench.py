"""`mlxcel-dist bench`: prefill and decode speed, time to first token, peak
memory and collective traffic of one generation, on random token ids (seeded,
so no tokenizer is needed and every rank and every run feeds the same ids).

Every rank runs `run_bench` (the same generation loop as `generate`:
generation.Generation (the engine's one row), greedy, EOS ignored so exactly `gen_tokens` ids come
out); rank 0 reports.

- warm-up: one short generation first (weights paged in, buffers allocated),
  then the peak-memory counter is reset; the timed run follows.
- ttft_s: prompt fed (chunked prefill) until the first id is read on the host,
  a compile of a new decode graph included; prefill_tok_s = prompt_tokens / ttft_s.
- decode_tok_s: (gen_tokens - 1) / the time from the first id to the last.
- peak_mem_gb: mx.get_peak_memory() of the timed run (resident weights + KV
  cache + activations), the max over ranks (per rank in peak_mem_gb_per_rank);
  weights_gb: MLX active memory after loading (max over ranks).
- all_sums_per_token / all_sum_bytes_per_token: measured. Every
  `mx.distributed.all_sum` built is counted with its payload bytes (the
  array's nbytes). A decode token's own collectives are counted on a probe:
  one single-token forward of the model on a fresh cache, built and never
  evaluated (the compiled split or whole-graph steps run the same layers, and
  a compiled step builds its collectives only when it traces). The
  rank-agreement guard's collectives are counted live during the timed run
  and divided by the generated count (its final check at the end of a
  generation is end_all_sums). The same for all_gather (the
  vocabulary-split output head); the *_plan keys are what the sharding plan
  predicts (`plan_collectives`).
- The timed run is `generate`'s own loop on the model itself: compiled decode
  steps run split (decode.SplitSegments) for the families that opt in, exactly
  as in `generate` and `serve`.
- compiled: decode steps compiled (default) or eager (`--no-compile`);
  decode_graphs: single-token step graphs built (warm-up included): the
  engine's traces when compiled (once per buffer shape), every step when
  eager.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from .engine.batch import BatchEngine
from .parallel.collectives import SINGLE, Group
from .engine.guard import vocab_size
from .engine.generation import Generation, engine_for
from .errors import UserError
from .engine.sampling import SamplingParams

GB = 1e9


def prompt_ids(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """`n` seeded random token ids in [0, vocab) (benchmarks/compare_mlx_lm.py feeds mlx-lm the same)."""
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


OPS = ("all_sum", "all_gather")


class CollectiveCounter:
    """Counts `mx.distributed.all_sum` / `all_gather` calls and payload bytes
    (each rank's input array) while active, by phase: "other" inside the
    rank-agreement guard, "decode" during `probe_decode`, "end" (set by the
    caller), "model" for everything else (the model's prefill and decode
    steps as they trace or run: not reported)."""

    def __init__(self):
        self.phase = "model"
        self.calls: dict = {}
        self.bytes: dict = {}

    def reset(self, *phases: str) -> None:
        for key in [k for k in self.calls if k[1] in phases]:
            del self.calls[key], self.bytes[key]

    def count(self, op: str, *phases: str) -> tuple[int, int]:
        return (sum(self.calls.get((op, p), 0) for p in phases), sum(self.bytes.get((op, p), 0) for p in phases))

    @contextlib.contextmanager
    def active(self):
        from .engine.guard import RankAgreement

        origs = {op: getattr(mx.distributed, op) for op in OPS}
        guard = {name: getattr(RankAgreement, name) for name in ("pending_rows", "check")}

        def counted(op):
            def call(x, *args, **kwargs):
                key = (op, self.phase)
                self.calls[key] = self.calls.get(key, 0) + 1
                self.bytes[key] = self.bytes.get(key, 0) + x.nbytes
                return origs[op](x, *args, **kwargs)
            return call

        def tagged(f):
            def call(*args, **kwargs):
                before = self.phase
                self.phase = "other" if before == "model" else before
                try:
                    return f(*args, **kwargs)
                finally:
                    self.phase = before
            return call

        for op in OPS:
            setattr(mx.distributed, op, counted(op))
        for name, f in guard.items():
            setattr(RankAgreement, name, tagged(f))
        try:
            yield self
        finally:
            for op, f in origs.items():
                setattr(mx.distributed, op, f)
            for name, f in guard.items():
                setattr(RankAgreement, name, f)

    def probe_decode(self, model) -> None:
        """Count one decode token's collectives: a single-token forward on a
        fresh cache, built lazily and dropped unevaluated."""
        self.phase = "decode"
        try:
            model(mx.zeros((1, 1), mx.int32), model.make_cache())
        finally:
            self.phase = "model"


def plan_collectives(model, check_every: int = 1, size: int = 1) -> dict:
    """Collectives per generated token that the sharding plan predicts, {op:
    (calls, payload bytes)}: one single-token forward pass (what the model
    says it issues: `collectives_per_token`, the model contract) plus the
    rank-agreement check ([size, 3] int32) every `check_every` tokens.
    Nothing at one rank."""
    if size <= 1:
        return {op: (0, 0) for op in OPS}
    plan = {op: list(model.collectives_per_token().get(op, (0, 0))) for op in OPS}
    if check_every:
        plan["all_sum"][0] += 1 / check_every
        plan["all_sum"][1] += size * 3 * 4 / check_every
    return {op: tuple(v) for op, v in plan.items()}


def _weights_dtype(model) -> str:
    from mlx.utils import tree_flatten

    kinds = sorted({str(v.dtype).split(".")[-1] for _, v in tree_flatten(model.parameters())
                    if mx.issubdtype(v.dtype, mx.floating)})
    return ",".join(kinds)


def timed_alone(model, prompt_ids, tokens: int = 16) -> float:
    """Seconds per decode token of this rank's stage on its own: its layers
    (and embedding or head) over a `prompt_ids` cache, one token at a time
    through a compiled one-row step of its own (batch.BatchEngine.scores),
    receiving zeros and sending nothing (the inside of a stage's tensor
    parallelism runs as ever, so every rank of the job calls this together).
    What `bench --pp` reports per stage."""
    import time

    stage = model.stage
    stage.alone = True
    try:
        engine = BatchEngine(model)  # its own traces: the job's compiled step sends and receives

        def run(n):
            cache = model.make_cache()
            mx.eval(model(mx.array(prompt_ids)[None], cache), [c.state for c in cache])
            t = time.perf_counter()
            engine.scores(cache, [0] * n, read=False)
            return time.perf_counter() - t

        run(2)  # the trace
        return (run(tokens + 1) - run(1)) / tokens
    finally:
        stage.alone = False


def check_lengths(prompt_tokens: int, gen_tokens: int) -> None:
    """The bench's own options (Generation checks the shared ones)."""
    if prompt_tokens < 1:
        raise UserError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    if gen_tokens < 1:
        raise UserError(f"--gen-tokens must be >= 1, got {gen_tokens}")


def run_bench(model, prompt_tokens: int, gen_tokens: int, *, group: Group = SINGLE, prefill_step: int | None = None,
              seed: int = 0, check_every: int = 1, warmup: bool = True, compiled: bool = True, drafter=None,
              ids=None) -> dict:
    """One warm-up and one timed generation; the result dict (same on every rank).
    `drafter`: speculative decoding (spec.py); `ids`: the prompt (default: seeded random ids)."""
    check_lengths(prompt_tokens, gen_tokens)
    size = group.size()
    weights_gb = mx.get_active_memory() / GB
    if ids is None:
        ids = prompt_ids(vocab_size(model), prompt_tokens, seed)
    ids = np.asarray(ids, np.int32)
    prompt_tokens = len(ids)

    def generator(prompt, n):
        return Generation(model, prompt, n, greedy, eos_ids=(), prefill_step=prefill_step, group=group,
                          check_every=check_every, compiled=compiled, spec=drafter)

    greedy = SamplingParams()
    counter = CollectiveCounter()
    step = engine_for(model)  # generate's own engine (one row: split steps where the family opts in)
    traces0 = step.traces
    with counter.active():
        warm_steps = 0
        if warmup:
            warm = generator(ids[: min(prompt_tokens, 32)], min(gen_tokens, 4 if drafter is None else 16))
            for _ in warm:
                pass
            warm_steps = warm.finish().generated
        counter.reset("other", "end", "model")  # the guard's counts: the timed run's only
        mx.synchronize()
        mx.reset_peak_memory()
        gen = generator(ids, gen_tokens)
        for _ in gen:
            pass
        counter.phase = "end"  # the final agreement check, once per generation
        stats = gen.finish()
        counter.phase = "model"
        counter.probe_decode(model)
    mx.synchronize()
    peak = mx.get_peak_memory() / GB
    stage = model.stage
    alone = timed_alone(model, ids[:16]) if stage is not None else 0.0
    per_rank = group.gather_rows([peak, weights_gb, alone])
    n = stats.generated
    plan = plan_collectives(model, check_every, size)
    ttft = stats.ttft_s  # a first step that compiled a new graph counts here too
    out = {
        "np": size,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": n,
        "prefill_step": gen.prefill_step,
        "dtype": _weights_dtype(model),
        "prefill_tok_s": prompt_tokens / ttft if ttft else 0.0,
        "decode_tok_s": stats.decode_tok_s,
        "ttft_s": ttft,
        "decode_ms_per_token": 1e3 * stats.decode_s / (n - 1) if n > 1 else 0.0,
        "peak_mem_gb": float(per_rank[:, 0].max()),
        "peak_mem_gb_per_rank": [float(v) for v in per_rank[:, 0]],
        "weights_gb": float(per_rank[:, 1].max()),
    }
    if stage is not None:
        # each stage's decode token alone (its first rank's: a stage's ranks work together), and the
        # share of a pipelined token its ranks sit idle (one stream: each stage waits for the others)
        T = size // stage.P
        stage_ms = [1e3 * float(per_rank[s * T, 2]) for s in range(stage.P)]
        token_ms = out["decode_ms_per_token"]
        out["stage_ms_per_token"] = stage_ms
        out["idle_share"] = max(0.0, 1 - sum(stage_ms) / (stage.P * token_ms)) if token_ms else 0.0
    for op in OPS:
        # one decode token's forward (the probe) + the guard's per token
        calls, nbytes = counter.count(op, "decode")
        g_calls, g_bytes = counter.count(op, "other")
        out[f"{op}s_per_token"] = calls + g_calls / n
        out[f"{op}_bytes_per_token"] = nbytes + g_bytes / n
        out[f"{op}s_per_token_plan"], out[f"{op}_bytes_per_token_plan"] = plan[op]
    out.update({
        "compiled": compiled,
        "decode_graphs": step.traces - traces0 if compiled else warm_steps + n,
        "split_decode": bool(compiled and step.splits(1)),
        "end_all_sums": counter.count("all_sum", "end")[0],
        "agreement_checks": stats.checks,
        "check_every": check_every,
    })
    if drafter is not None:
        out.update({"drafter": drafter.name, "num_draft_tokens": drafter.k, "verify_forwards": stats.rounds,
                    "drafted": stats.drafted, "accepted": stats.accepted,
                    "acceptance": stats.accepted / stats.drafted if stats.drafted else 0.0,
                    "mean_accepted": stats.mean_accepted})
    return out


def format_table(r: dict) -> str:
    rows = [
        ("ranks", f"{r['np']}"),
        ("dtype", r["dtype"]),
        ("prompt / generated", f"{r['prompt_tokens']} / {r['gen_tokens']} tokens (prefill step {r['prefill_step']})"),
        ("prefill", f"{r['prefill_tok_s']:.1f} tok/s"),
        ("time to first token", f"{r['ttft_s']:.3f} s"),
        ("decode", f"{r['decode_tok_s']:.2f} tok/s ({r['decode_ms_per_token']:.1f} ms/token)"),
        ("peak memory", f"{r['peak_mem_gb']:.3f} GB (max over ranks; per rank "
                        f"{', '.join(f'{v:.3f}' for v in r['peak_mem_gb_per_rank'])}); weights {r['weights_gb']:.3f} GB"),
        ("all_sum per token", f"{r['all_sums_per_token']:g} calls, {r['all_sum_bytes_per_token']:g} bytes "
                              f"(plan: {r['all_sums_per_token_plan']:g}, {r['all_sum_bytes_per_token_plan']:g} bytes)"),
        ("all_gather per token", f"{r['all_gathers_per_token']:g} calls, {r['all_gather_bytes_per_token']:g} bytes "
                                 f"(plan: {r['all_gathers_per_token_plan']:g}, "
                                 f"{r['all_gather_bytes_per_token_plan']:g} bytes)"),
    ]
    if "drafter" in r:
        rows.append(("drafts", f"{r['drafter']}, {r['num_draft_tokens']} a round: {r['drafted']} drafted, "
                               f"{r['accepted']} accepted ({100 * r['acceptance']:.0f}%) in {r['verify_forwards']} "
                               f"verify forwards; mean accepted length {r['mean_accepted']:.2f}"))
    if "stage_ms_per_token" in r:
        rows.append(("stages (alone)", f"{', '.join(f'{v:.1f}' for v in r['stage_ms_per_token'])} ms/token; "
                                       f"idle share {100 * r['idle_share']:.0f}%"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
