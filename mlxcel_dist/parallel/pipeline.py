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
  compiled decode step (the engine's rows) runs under pp as it is. Split
  decode steps (attention kernels between compiled segments) are not used
  under pp (their first segment embeds): the whole-step graph runs instead.
  A backend without them (NCCL) hands on by collectives instead
  (`handoff_mode`, `--pp-handoff`; `collectives.HandOff`), the same bits.
- Every point-to-point transfer goes through `Stage.receive_tensor(shape,
  dtype)` (from the previous stage) and `Stage.send_tensor(x)` (to the next;
  each forward's sends are kept in `sent`, so the logits' zeros depend on all
  of them and `take_sent` hands them all to a caller that evaluates only the
  caches). `receive` / `pass_on` are the hidden state's case.
- What a layer kind hands on besides the hidden state travels with it, in
  one message per hop (models/base.py `send_packed` / `receive_packed`: MLX's
  recv takes no inputs, so two receives in one graph have no order to match
  two sends): gemma3n's AltUp streams [n, B, L, H] (as [B, L, n * H]) and
  gemma3n / gemma4's per-layer inputs of the layers after the stage
  ([B, L, (N - stop) * P]). The first stage computes them once from the
  ids, as one process does: recomputing them on each stage would need the
  embedding and the per-layer table (the largest tensor of the E2B / E4B
  checkpoints, V x N * P) on every stage; sent, they cost (N - stop) * P
  values a token per hop.
- Shared KV (gemma3n, gemma4: a layer reading another layer's keys/values)
  never travels: the cut keeps each reading layer on its source's stage
  (`CausalLM.stage_cuts`, base.kv_sharing_cuts, passed to `stage_ranges`
  as the allowed starts), since the KV would be the whole cache every step.
  A model with too few legal cuts for P stages is refused before launch,
  one line (`loader.check_stageable`). This can unbalance the stages: the shared
  layers and their sources sit on one stage (12 of 30 layers when the last
  10 share the KV of layers 18 and 19).
- Each stage's caches are its layers' (sliding, full, shared, recurrent:
  `make_cache` over `stage_layer_types`; a SharedKVCache's `reads_layer`
  indexes the stage's list), in every feeding mode.

A family runs in stages when its `Model` says `pipeline_stages = True` (all
but diffusion_gemma, whose own generation loop over an encoder and a decoder
is refused before launch: `check_family`, `REFUSED`). A stack's modules
outside its layers go to the first stage (`first_stage_parts`: the
embedding; gemma3n's per-layer embeddings and AltUp projections, ...) or the
last (`last_stage_parts`: the final norm; gemma3n's AltUp unembedding), and
count there in the balance (`stage_parts`, `plan_stages`).
"""

from __future__ import annotations

from fractions import Fraction

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError
from ..checkpoint.weights import stored_bytes

# Families (model files) refused under --pp, and why (one clause each).
REFUSED = {
    "diffusion_gemma": "it runs its own generation loop (block diffusion) over an encoder and a decoder",
}

# Why a model's layers may be cut only at some boundaries (CausalLM.stage_cuts).
KV_CUTS = "a layer that reads another layer's KV stays on that layer's stage"


def stage_ranges(layer_bytes, P: int, first_extra: int = 0, last_extra: int = 0,
                 cuts=None, weights=None) -> list[tuple[int, int]]:
    """Contiguous [start, stop) layer ranges, one per stage, every stage at
    least one layer, that minimise the largest stage's bytes (its layers, plus
    `first_extra` on the first stage and `last_extra` on the last: embedding
    and head) or, with `weights` (one per stage: its ranks' memory or speed),
    the largest bytes / weight. `cuts`: the layers a stage other than the
    first may start at (None: any; too few for P stages is refused, saying
    why: `KV_CUTS`). Ties go to the earliest split points that reach the
    optimum; the ratios are exact fractions (deterministic: every rank
    computes the same ranges)."""
    n = len(layer_bytes)
    if P < 1:
        raise UserError(f"--pp must be >= 1, got {P}")
    if P > n:
        raise UserError(f"--pp {P} needs at least {P} layers, the model has {n}")
    allowed = set(range(1, n)) if cuts is None else {int(c) for c in cuts if 0 < c < n}
    if len(allowed) < P - 1:
        starts = ", ".join(map(str, sorted(allowed))) or "none"
        raise UserError(f"--pp {P} needs {P - 1} stage boundaries, but this model's {n} layers can be cut only "
                        f"before layer(s) {starts} ({KV_CUTS}): at most --pp {len(allowed) + 1}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + int(b))

    if weights is not None and len(weights) != P:
        raise UserError(f"{len(weights)} stage weights for --pp {P}")
    share = [Fraction(1)] * P if weights is None else [Fraction(w) for w in weights]

    def cost(p, j, i):  # stage p holding layers [j, i), per unit of its weight
        own = prefix[i] - prefix[j] + (first_extra if p == 0 else 0) + (last_extra if p == P - 1 else 0)
        return own / share[p]

    INF = float("inf")
    # best[p][i]: the smallest possible largest stage of layers [0, i) in stages 0..p
    best = [[INF] * (n + 1) for _ in range(P)]
    cut = [[0] * (n + 1) for _ in range(P)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for p in range(1, P):
        for i in range(p + 1, n + 1):
            for j in range(p, i):
                if j not in allowed:
                    continue
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


def stage_parts(stack) -> tuple[tuple, tuple]:
    """The stack's modules outside its layers that only the first stage holds
    (`first_stage_parts`: the embedding, and e.g. gemma3n's per-layer
    embeddings and AltUp projections) and only the last (`last_stage_parts`:
    the final norm, ...). Plain stacks: embed_tokens and norm."""
    return stack.first_stage_parts, stack.last_stage_parts


def plan_stages(model, refs: dict, P: int, weights=None) -> list[tuple[int, int]]:
    """`stage_ranges` from the (sanitized) checkpoint headers: bytes per
    layer, the first stage's parts (the embedding, ...) on the first stage,
    the head's (a tied head: the embedding matrix again, which the last stage
    also holds) and the last stage's parts on the last; only the cut points
    the model allows (`stage_cuts`: shared KV stays on one stage). `weights`:
    the job's rank weights (--rank-weights, a hostfile's weight= / memory=):
    each stage's bytes follow the sum of its ranks' (`stage_weights`)."""
    n = len(model.model.layers)
    first_parts, last_parts = stage_parts(model.model)
    per_layer = [0] * n
    embed = first = last = head = 0
    for name, ref in refs.items():
        i = layer_index(name)
        part = name.split(".")[1] if name.startswith("model.") else None
        if i is not None and i < n:
            per_layer[i] += stored_bytes(ref)
        elif name.startswith("lm_head."):
            head += stored_bytes(ref)
        elif part in first_parts:
            first += stored_bytes(ref)
            embed += stored_bytes(ref) if part == "embed_tokens" else 0
        elif part in last_parts and not part.endswith("norm"):  # a final norm (a vector) is left out, as ever
            last += stored_bytes(ref)
    if model.args.tie_word_embeddings:
        head = embed
    cuts = model.stage_cuts()
    return stage_ranges(per_layer, P, first_extra=first, last_extra=last + head, cuts=cuts,
                        weights=stage_weights(weights, P))


def stage_weights(weights, P: int):
    """Each stage's weight: the sum of its T = len(weights) / P ranks'
    (None: equal stages)."""
    if weights is None:
        return None
    T = len(weights) // P
    return [sum(Fraction(w) for w in weights[s * T:(s + 1) * T]) for s in range(P)]


def member_weights(weights, rank: int, P: int):
    """The rank weights of the stage holding world rank `rank` (its
    tensor-parallel split; None when equal or absent)."""
    if weights is None:
        return None
    _, _, T = stage_of(rank, len(weights), P)
    s = rank // T
    return tuple(weights[s * T:(s + 1) * T])


def check_family(model) -> None:
    """Refuse a family that cannot run in stages (one line, before launch)."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if not model.pipeline_stages:
        why = REFUSED.get(family, "it does not declare pipeline_stages")
        raise UserError(f"--pp: {model.args.model_type} ({family}) cannot run in pipeline stages: {why}")


def check_pp_ranks(np_: int, pp: int) -> int:
    """The rank count of a --pp run: P (one rank per stage; --np 1, the
    default, or --np P) or P x T (--np P x T: T-way tensor parallel inside
    each stage)."""
    if pp < 1:
        raise UserError(f"--pp must be >= 1, got {pp}")
    if pp == 1 or np_ == 1:
        return max(np_, pp)
    if np_ % pp:
        raise UserError(f"--np {np_} is not a multiple of --pp {pp} (--np P x T: T tensor-parallel ranks per stage)")
    return np_


def stage_of(rank: int, size: int, P: int) -> tuple[int, int, int]:
    """(stage, member, T) of world rank `rank` in a job of `size` ranks in P
    stages: stage s holds the T = size / P consecutive ranks [s T, (s+1) T)."""
    T = size // P
    return rank // T, rank % T, T


def comm_stream(group) -> None:
    """Give the job's collectives a stream of their own on the CPU device: ring
    and MPI run them on the default CPU stream, where a stage waiting to
    receive (or in the logits' all_sum) would hold up its own compute of the
    next micro-batch. One stream for all of them keeps their order (every
    rank's FIFO). On a GPU (or with one rank) the backend's stream stays."""
    if group.raw is not None and group.stream is None and mx.default_device() == mx.cpu:
        group.stream = mx.new_stream(mx.cpu)


HANDOFFS = ("auto", "send", "collective")


def handoff_mode(requested: str, backend: str | None, P: int, T: int) -> str:
    """How the stages of a `backend` job hand on: "send" (MLX's send/recv;
    a stage's T ranks sum by `ChainGroup`s of them) or "collective" (no
    point-to-point op: `collectives.HandOff`, and a stage's ranks sum over a
    `SplitGroup`). auto: send where the backend has point-to-point ops
    (`Backend.point_to_point`; not nccl). A UserError (before launch) where
    no path exists: send on a backend without it, or T > 1 ranks per stage
    without point-to-point on a backend that cannot split a group."""
    from ..cluster import backends

    if requested not in HANDOFFS:
        raise UserError(f"--pp-handoff must be one of {', '.join(HANDOFFS)}, got {requested!r}")
    spec = backends.get(backend) if backend else None  # None: a planned group (on paper)
    p2p = spec is None or spec.point_to_point
    mode = requested if requested != "auto" else "send" if p2p else "collective"
    if mode == "send" and not p2p:
        raise UserError(f"--pp-handoff send: backend {backend} has no point-to-point ops (MLX's send/recv); "
                        f"its stages hand on by collectives (--pp-handoff auto or collective)")
    if mode == "collective" and T > 1 and spec is not None and not spec.splits:
        why = "no point-to-point ops" if not p2p else "--pp-handoff collective"
        raise UserError(f"--np {P * T} --pp {P} on backend {backend}: {T} tensor-parallel ranks per stage need "
                        f"point-to-point ops or a group split, and {backend} cannot split groups ({why}); "
                        f"run --np {P} (one rank per stage)" + (" or --pp-handoff send" if p2p else ""))
    return mode


def stage_group(group, P: int):
    """The tensor-parallel group inside this rank's stage: `SINGLE` at T = 1,
    else a `collectives.ChainGroup` of the stage's T ranks (a `SplitGroup`
    where the stages hand on by collectives)."""
    from .collectives import SINGLE, ChainGroup, SplitGroup

    s, _, T = stage_of(group.rank(), group.size(), P)
    if T == 1:
        return SINGLE
    collective = handoff_mode(group.pp_handoff, group.backend, P, T) == "collective"
    chain = SplitGroup(group, s) if collective else ChainGroup(group, s * T, T)
    chain.set_weights(member_weights(group.weights, group.rank(), P))
    return chain


class Absent(nn.Module):
    """A layer another stage holds: no parameters, never called."""

    def __call__(self, *args, **kwargs):  # pragma: no cover - a bug if reached
        raise RuntimeError("a layer of another pipeline stage was called")


class Stage:
    """Stage `index` of a `P`-stage pipeline over `group` (the whole job),
    this rank its `member`-th of T tensor-parallel ranks: layers [start,
    stop), the dtype of the hidden states it receives and sends.

    Hidden states always come from world rank r-1 and go to r+1 (ring
    neighbours): the previous stage's last rank sends to this stage's first,
    which forwards them to the next member, and so on; only a stage's last
    member sends on (its T ranks hold the same h after their all_sums)."""

    def __init__(self, group, index: int, P: int, start: int, stop: int, hidden_size: int, dtype,
                 member: int = 0, T: int = 1):
        self.group, self.index, self.P = group, index, P
        self.member, self.T = member, T
        self.start, self.stop = start, stop
        self.hidden_size, self.dtype = hidden_size, dtype
        self.sent = []  # this forward's lazy sends (callers that evaluate only the caches need them)
        self.tp = None  # the stage's ChainGroup at T > 1 (loader: the model is sharded over it)
        self.handoff = None  # a collectives.HandOff where the stages hand on by collectives
        self.alone = False  # `timed_alone`: this stage's work without the other stages

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.P - 1

    def __repr__(self) -> str:
        tp = f", rank {self.member} of {self.T}" if self.T > 1 else ""
        return f"Stage({self.index} of {self.P}{tp}: layers [{self.start}, {self.stop}))"

    def begin(self) -> None:
        """A new forward (the stack's `__call__`): the previous one's sends are
        dropped (evaluated with its logits, or traced inside a compiled step)."""
        self.sent = []
        for chained in (self.tp, self.handoff):
            if chained is not None:
                chained.reset()

    def receive_tensor(self, shape, dtype) -> mx.array:
        """The previous stage's tensor (shape, dtype), forwarded to this
        stage's next member when there is one (every point-to-point receive
        goes through here)."""
        r = self.group.rank()
        if self.alone:
            return mx.zeros(tuple(shape), dtype)
        if self.handoff is not None:
            return self.handoff.receive(shape, dtype)
        x = mx.distributed.recv(tuple(shape), dtype, r - 1, group=self.group.raw, stream=self.group.stream)
        if self.member < self.T - 1:
            (x,) = mx.depends([x], [mx.distributed.send(x, r + 1, group=self.group.raw, stream=self.group.stream)])
        return x

    def send_tensor(self, x: mx.array) -> mx.array:
        """x to the next stage (from this stage's last member; the others
        return x; every point-to-point send goes through here): the lazy
        result does the send when evaluated, kept in `sent` for the logits'
        dependency and `take_sent`."""
        if self.member < self.T - 1 or self.alone:
            # kept too: a caller evaluating only the caches must still run this rank's share of the
            # stage's last all_sum, which the sending member evaluates (or their chains part ways)
            self.sent.append(x)
            return x
        if self.handoff is not None:
            hops = self.handoff.send(x)
            self.sent += hops
            return hops[0]
        x = mx.distributed.send(x, self.group.rank() + 1, group=self.group.raw, stream=self.group.stream)
        self.sent.append(x)
        return x

    def receive(self, B: int, L: int) -> mx.array:
        return self.receive_tensor((B, L, self.hidden_size), self.dtype)

    def pass_on(self, h: mx.array) -> mx.array:
        """h (in the stage dtype) to the next stage."""
        return self.send_tensor(h.astype(self.dtype))

    def logits(self, head, h: mx.array, vocab: int) -> mx.array:
        """Every rank's copy of the last stage's logits: `head(h)` there (on
        every member: a vocabulary-split head gathers inside the stage), from
        its first member only; zeros (after this rank's sends) elsewhere; one
        all_sum over the job."""
        if self.last:
            out = head(h)
            # the other ranks' zeros are in the hidden dtype: the head's output is too
            # (the loader casts every weight to it), but a mismatch would pair
            # all_sums of different sizes, so it is made sure of
            out = out if out.dtype == self.dtype else out.astype(self.dtype)
            if self.member > 0:
                out = mx.depends(mx.zeros(out.shape, self.dtype), out)
        else:  # after every send of this forward (h may be only one of them)
            out = mx.depends(mx.zeros((*h.shape[:-1], vocab), self.dtype), [h, *self.sent])
        return out if self.alone else self.group.all_sum(out)

    def take_sent(self) -> list:
        """The last forward's sends (to evaluate with the caches), once."""
        sent, self.sent = self.sent, []
        return sent


def outstanding_sends(model) -> list:
    """What a caller that evaluates only the caches (chunked prefill) must
    evaluate too: this stage's send of the hidden state ([] unstaged)."""
    stage = model.stage
    return stage.take_sent() if stage is not None else []


def make_stage(model, group, P: int, ranges: list, dtype) -> Stage:
    """Keep this rank's stage of `model` (`stage_of`), in place: its layers
    (the others become `Absent`), the first stage's parts (the embedding,
    `stage_parts`; with a tied head the last stage keeps the embedding too),
    the last stage's parts (the final norm) and `lm_head` on the last."""
    index, member, T = stage_of(group.rank(), group.size(), P)
    start, stop = ranges[index]
    stack = model.model
    stage = Stage(group, index, P, start, stop, model.args.hidden_size, dtype, member, T)
    stage.ranges = [tuple(r) for r in ranges]  # every stage's, as every rank computed them
    stack.layers = [layer if start <= i < stop else Absent() for i, layer in enumerate(stack.layers)]
    first_parts, last_parts = stage_parts(stack)
    tied_head = stage.last and model.args.tie_word_embeddings
    for name in first_parts if not stage.first else ():
        if name in stack and not (name == "embed_tokens" and tied_head):
            del stack[name]
    if not stage.last:
        for name in last_parts:
            if name in stack:
                del stack[name]
        if "lm_head" in model:
            del model["lm_head"]
    stack.stage = stage
    if P > 1 and group.raw is not None and handoff_mode(group.pp_handoff, group.backend, P, T) == "collective":
        from ..cluster import backends
        from .collectives import HandOff

        widths = [model.stage_send_width(stop) for _, stop in ranges[:-1]]
        stage.handoff = HandOff(group, P, T, widths, split=backends.get(group.backend).splits)
    return stage
