"""Pipeline parallelism (`--pp P`): the decoder's layers split into P
contiguous stages, one per rank; hidden states go from stage to stage.

```
rank 0 (stage 0)          rank 1 (stage 1)          ...  rank P-1 (last stage)
embed_tokens              recv h [B, L, H] from 0        recv h from P-2
layers [0, s1)            layers [s1, s2)                layers [s_{P-1}, N)
send h to rank 1 ──────►  send h to rank 2 ──────► ...   norm, head -> logits
zeros [B, L, V]           zeros [B, L, V]                logits [B, L, V]
        └──────────────── one all_sum: every rank has the last stage's logits ┘
```

- `stage_ranges(layer_bytes, P)`: which layers each stage holds, balanced by
  parameter bytes (the embedding on the first stage and the head on the last
  count too: `first_extra`, `last_extra`), read from the checkpoint's
  tensor headers (`plan_stages`: no tensor data is read).
- `make_stage(model, ...)`: rank r's model keeps the modules of its stage only
  (the other layers become `Absent`, which holds nothing, so layer i keeps
  the name `model.layers.i` and the loader's strict check applies to exactly
  this stage's parameters); `DecoderStack` and `CausalLM` (models/base.py)
  then run the stage's layers, caches and masks through the `Stage` object.
- The logits reach every rank through one all_sum in which the other stages
  contribute zeros (x + 0 = x exactly, also in floats): every rank then runs
  the same sampler on bit-identical logits, so generation's rank-agreement
  invariant and check stay as they are, and `sequence_logits` has them on
  rank 0, which writes them. Broadcasting only the sampled id would move 4
  bytes a token instead of V x dtype (512 KiB for a 262k-vocabulary bf16
  head), but the sampler, logprobs and the logits commands would then need a
  path of their own on the last stage; for this first slice the logits go
  (docs/architecture.md, "Pipeline stages", has the numbers).
- send/recv are MLX's point-to-point ops (`mx.distributed.send` / `recv`,
  MPI and ring backends in MLX 0.32); they trace inside `mx.compile`, so the
  compiled decode step (decode.DecodeStep) runs under pp as it is. Split
  decode steps (attention kernels between compiled segments) are not used
  under pp (their first segment embeds): the whole-step graph runs instead.

A family runs in stages when its `Model` says `pipeline_stages = True`;
those whose layers read other layers' state (KV sharing, per-layer inputs), a
stack with its own forward, or a model with its own generation loop are
refused before launch (`check_family`, `REFUSED`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .errors import UserError
from .weights import stored_bytes

TP_INSIDE_STAGE = "--pp with tensor parallel inside a stage is not supported yet"

# Families (model files) refused under --pp, and why (one clause each).
REFUSED = {
    "gemma3n": "its layers share KV caches across the stack and take per-layer inputs (AltUp, per-layer embeddings)",
    "gemma4": "its layers share KV caches across the stack and take per-layer inputs",
    "recurrent_gemma": "its decoder stack (recurrent blocks, its own forward) is not split into stages yet",
    "diffusion_gemma": "it runs its own generation loop (block diffusion) over an encoder and a decoder",
}


def stage_ranges(layer_bytes, P: int, first_extra: int = 0, last_extra: int = 0) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges, one per stage, every stage at
    least one layer, that minimise the largest stage's bytes (its layers, plus
    `first_extra` on the first stage and `last_extra` on the last: embedding
    and head). Ties go to the earliest split points that reach the optimum
    (deterministic: every rank computes the same ranges)."""
    n = len(layer_bytes)
    if P < 1:
        raise UserError(f"--pp must be >= 1, got {P}")
    if P > n:
        raise UserError(f"--pp {P} needs at least {P} layers, the model has {n}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + int(b))

    def cost(p, j, i):  # stage p holding layers [j, i)
        return prefix[i] - prefix[j] + (first_extra if p == 0 else 0) + (last_extra if p == P - 1 else 0)

    INF = float("inf")
    # best[p][i]: the smallest possible largest stage of layers [0, i) in stages 0..p
    best = [[INF] * (n + 1) for _ in range(P)]
    cut = [[0] * (n + 1) for _ in range(P)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for p in range(1, P):
        for i in range(p + 1, n + 1):
            for j in range(p, i):
                c = max(best[p - 1][j], cost(p, j, i))
                if c < best[p][i]:
                    best[p][i], cut[p][i] = c, j
    bounds, i = [n], n
    for p in range(P - 1, 0, -1):
        i = cut[p][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [(bounds[k], bounds[k + 1]) for k in range(P)]


def layer_index(name: str) -> int | None:
    """i of a `model.layers.i.*` parameter name (None for any other)."""
    if not name.startswith("model.layers."):
        return None
    part = name.split(".", 3)[2]
    return int(part) if part.isdigit() else None


def plan_stages(model, refs: dict, P: int) -> list[tuple[int, int]]:
    """`stage_ranges` from the (sanitized) checkpoint headers: bytes per
    layer, the embedding's on the first stage, the head's on the last (a
    tied head: the embedding matrix again, which the last stage also holds)."""
    n = len(model.model.layers)
    per_layer = [0] * n
    embed = head = 0
    for name, ref in refs.items():
        i = layer_index(name)
        if i is not None and i < n:
            per_layer[i] += stored_bytes(ref)
        elif name.startswith("model.embed_tokens."):
            embed += stored_bytes(ref)
        elif name.startswith("lm_head."):
            head += stored_bytes(ref)
    if model.args.tie_word_embeddings:
        head = embed
    return stage_ranges(per_layer, P, first_extra=embed, last_extra=head)


def check_family(model) -> None:
    """Refuse a family that cannot run in stages (one line, before launch)."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if not getattr(model, "pipeline_stages", False):
        why = REFUSED.get(family, "it does not declare pipeline_stages")
        raise UserError(f"--pp: {model.args.model_type} ({family}) cannot run in pipeline stages: {why}")


def check_pp_ranks(np_: int, pp: int) -> int:
    """The rank count of a --pp run: P (one rank per stage; --np 1, the
    default, or --np P). T ranks per stage (--np P x T) is refused."""
    if pp < 1:
        raise UserError(f"--pp must be >= 1, got {pp}")
    if pp == 1 or np_ in (1, pp):
        return max(np_, pp)
    if np_ % pp == 0:
        raise UserError(TP_INSIDE_STAGE)
    raise UserError(f"--np {np_} is not a multiple of --pp {pp}")


def check_stageable(model_arg, pp: int) -> None:
    """Before launch: the family runs in stages and has at least `pp` layers."""
    from .loader import open_model

    m, refs = open_model(model_arg).build()
    check_family(m)
    plan_stages(m, refs, pp)


class Absent(nn.Module):
    """A layer another stage holds: no parameters, never called."""

    def __call__(self, *args, **kwargs):  # pragma: no cover - a bug if reached
        raise RuntimeError("a layer of another pipeline stage was called")


class Stage:
    """Rank `index` of a `P`-stage pipeline over `group` (the whole job):
    layers [start, stop), the dtype of the hidden states it receives/sends."""

    def __init__(self, group, index: int, P: int, start: int, stop: int, hidden_size: int, dtype):
        self.group, self.index, self.P = group, index, P
        self.start, self.stop = start, stop
        self.hidden_size, self.dtype = hidden_size, dtype
        self.sent = None  # the last forward's lazy send (callers that evaluate only the caches need it)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.P - 1

    def __repr__(self) -> str:
        return f"Stage({self.index} of {self.P}: layers [{self.start}, {self.stop}))"

    def receive(self, B: int, L: int) -> mx.array:
        return mx.distributed.recv((B, L, self.hidden_size), self.dtype, self.index - 1, group=self.group.raw)

    def pass_on(self, h: mx.array) -> mx.array:
        """Send h to the next stage; the lazy result (h itself) does the send when evaluated."""
        self.sent = mx.distributed.send(h.astype(self.dtype), self.index + 1, group=self.group.raw)
        return self.sent

    def logits(self, head, h: mx.array, vocab: int) -> mx.array:
        """Every rank's copy of the last stage's logits: `head(h)` there, zeros
        (after this stage's send) elsewhere, one all_sum."""
        if self.last:
            out = head(h)
            # the other ranks' zeros are in the hidden dtype: the head's output is too
            # (the loader casts every weight to it), but a mismatch would pair
            # all_sums of different sizes, so it is made sure of
            out = out if out.dtype == self.dtype else out.astype(self.dtype)
        else:
            out = mx.depends(mx.zeros((*h.shape[:-1], vocab), self.dtype), h)
        return self.group.all_sum(out)

    def take_sent(self) -> list:
        """The last forward's send (to evaluate with the caches), once."""
        sent, self.sent = self.sent, None
        return [] if sent is None or self.last else [sent]


def outstanding_sends(model) -> list:
    """What a caller that evaluates only the caches (chunked prefill) must
    evaluate too: this stage's send of the hidden state ([] unstaged)."""
    stage = getattr(getattr(model, "model", None), "stage", None)
    return stage.take_sent() if stage is not None else []


def make_stage(model, group, P: int, ranges: list, dtype) -> Stage:
    """Keep rank r's stage of `model`, in place: its layers (the others become
    `Absent`), the embedding on the first stage (and on the last with a tied
    head), the final norm and `lm_head` on the last."""
    r = group.rank()
    start, stop = ranges[r]
    stack = model.model
    stage = Stage(group, r, P, start, stop, model.args.hidden_size, dtype)
    stack.layers = [layer if start <= i < stop else Absent() for i, layer in enumerate(stack.layers)]
    if not stage.first and not (stage.last and model.args.tie_word_embeddings):
        del stack["embed_tokens"]
    if not stage.last:
        del stack["norm"]
        if "lm_head" in model:
            del model["lm_head"]
    stack.stage = stage
    return stage
