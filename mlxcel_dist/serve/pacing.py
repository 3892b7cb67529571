"""How many prompt tokens each step prefills beside the decoding rows
(rank 0's scheduler decides, the step carries it to every rank).

A mixed step costs the rows' decode plus the prompt chunk, and a running
stream's gap between tokens is that step. `Pacer` keeps two moving averages
from the steps it is told of: a step with decoding rows and no prefill (d),
and a prompt token's cost inside a step (p, the step's time less d, per
token prefilled). It then gives prompts HEADROOM x (STALL - 1) x d / p tokens
a step, so a stream's gap stays within STALL x its plain gap (the headroom:
for the steps' spread) while the prompts get what is left. On a device
where a prompt token costs about a decode row's token (a CPU) that is a
share of the work.

Where a chunk's forward costs a fixed time whatever its size (a GPU's host
time for an eager forward: 20-55 ms for a 12B gemma3 on the H200 beside a
15 ms decode step), p read from small chunks is mostly that fixed part, and
the smallest chunk nearly fills the bound or breaks it: 8-token chunks then
stall every step and take a long prompt 13-22x its time alone. `Pacer`
tells this case apart by the last long chunk (LONG tokens or more: a prompt
alone, or the engine's first budget): where the smallest chunk's cost less
its tokens' work at that chunk's per-token cost p_long (its fixed part) is
most of that cost and over half the room the bound leaves, the prompt takes
chunks of (STALL - 1) x (d + the smallest chunk's cost) / p_long tokens:
fewer, longer gaps, and its first token far sooner. Until both averages are
known it answers 0: the engine's own `prefill.Budget` applies.
`serve --max-num-batched-tokens` fixes the budget instead (no pacing).

Where the chunk rides in the rows' forward (a GPU: engine/flat.py), a step
costs d + F + n x p: F, the flat step's own kernels (the chunk's attention,
its writes), is most of a small chunk's cost and p is small. Those steps are
paced apart: F from the steps of the fewest tokens (MIN_TOKENS), once, then
one probe of LONG tokens for p (kept by the steps of LONG tokens or more,
each weighted by its tokens), then max(room - F, F) / p tokens a step, the
room HEADROOM x (S - 1) x d (where F alone takes the room: (S - 1) x (d + F)
/ p, few long steps). A step that traced a new graph is no measure of either
kind, nor is a step OUTLIER x longer than its averages predict, once (a
kernel compiled for a shape run the first time: 2-6 s on a fresh H200,
untraced; a second such step of its kind in a row is taken as a real change). The
engine turns the tokens into one of few chunk sizes (each a graph to trace:
prefill.Together._flat_size), so the averages' drift asks for no new shape.
"""

from __future__ import annotations

STALL = 3.0  # a running stream's gap while prompts prefill, at most this x its plain gap (serve --max-stall)
MIN_TOKENS = 8  # prompt tokens a step at the least (prompts always move)
MAX_TOKENS = 8192
EMA = 0.2  # weight of the newest step in each average
LONG = 128  # a chunk of at least this many tokens tells a per-token cost from a fixed one
# the share of the bound's room the prompt is given: the bound is on the longest gap, so the
# average mixed step aims below it (at 1.0 the longest gaps came out 3.3-3.6x at --max-stall 3)
HEADROOM = 0.8
FIXED = 0.75  # a chunk's cost is fixed where that part is over this share of the smallest chunk's
OUTLIER = 5.0  # a step this many times longer than the averages predict is skipped, once
MAX_WEIGHT = 0.5  # the most a flat step's tokens weigh in a token's cost (EMA at LONG tokens, more as they grow)


class Pacer:
    """`stall`: the bound S. Where a prompt token costs what it costs alone,
    the prompt then runs (S - 1) / S of each step: its first token comes at
    least 1 + 1 / (S - 1) x later than alone (1.5x at 3), the trade-off
    --max-stall moves (MIN_TOKENS can exceed S where one prompt token costs
    over (S - 1) / MIN_TOKENS of a step: long prompts on a CPU, where a
    floor of 1 measured a worse first token for no shorter gap)."""

    def __init__(self, stall: float = STALL):
        self.stall = stall
        self.decode_s: float | None = None  # d: a step of decoding rows alone
        self.token_s: float | None = None  # p: one prompt token inside a step
        self.floor_s: float | None = None  # a smallest chunk's cost beyond d (MIN_TOKENS or fewer)
        self.long_token_s: float | None = None  # a token's cost in the last chunk of LONG tokens or more
        self.flat = False  # chunks ride in the rows' forward: the flat pacing
        self.flat_fixed_s: float | None = None  # F: a flat step's cost beyond d at MIN_TOKENS or fewer
        self.flat_token_s: float | None = None  # p: a prompt token's cost beyond F in a flat step of LONG or more
        self._outlier: dict = {}  # per step kind: its last step was an outlier (see the module docstring)

    def observe(self, seconds: float, rows: int, prefilled: int, flat: bool = False, traced: bool = False) -> None:
        """One engine step: `rows` decoded an id, `prefilled` prompt tokens ran
        (`flat`: in the rows' forward); `traced`: it traced a new graph."""
        if traced:
            return
        expected = self._expected(rows, prefilled, flat)
        kind = "flat" if flat else "mixed" if prefilled else "plain"
        outlier = expected is not None and seconds > OUTLIER * expected
        skip = outlier and not self._outlier.get(kind)
        self._outlier[kind] = outlier
        if skip:
            return
        if flat:
            self._observe_flat(seconds - (self.decode_s or 0.0), prefilled)
            return
        if rows and not prefilled:
            self.decode_s = seconds if self.decode_s is None else (1 - EMA) * self.decode_s + EMA * seconds
        elif prefilled and (self.decode_s is not None or not rows):
            extra = max(seconds - (self.decode_s if rows else 0.0), 0.0)
            per = extra / prefilled
            self.token_s = per if self.token_s is None else (1 - EMA) * self.token_s + EMA * per
            if prefilled >= LONG:
                self.long_token_s = per
            elif prefilled <= MIN_TOKENS and rows:
                self.floor_s = extra if self.floor_s is None else (1 - EMA) * self.floor_s + EMA * extra

    def _expected(self, rows: int, n: int, flat: bool) -> float | None:
        """What the averages say a step of `rows` and `n` prompt tokens takes
        (None: not measured yet)."""
        if not rows or self.decode_s is None:
            return None
        if not n:
            return self.decode_s
        if flat:
            if self.flat_fixed_s is None or self.flat_token_s is None:
                return None
            return self.decode_s + self.flat_fixed_s + n * self.flat_token_s
        return self.decode_s + n * self.token_s if self.token_s else None

    def _observe_flat(self, extra: float, n: int) -> None:
        self.flat = True
        extra = max(extra, 0.0)
        # F from the smallest chunks; while it is unknown, from any short one (the engine reuses a chunk size
        # run before, within twice the offer: asked MIN_TOKENS it ran 16 a step and F was never measured,
        # so a 1,500-token prompt crept in at 16 tokens a step on the H200)
        if n <= MIN_TOKENS or (self.flat_fixed_s is None and n < LONG):
            self.flat_fixed_s = extra if self.flat_fixed_s is None else (1 - EMA) * self.flat_fixed_s + EMA * extra
        elif self.flat_fixed_s is not None:
            # a long step cheaper than F read F high (the H200: 8 tokens 75 ms, 128 tokens 32 ms,
            # the first just after a trace): F is at most that step's extra, and a token costs at
            # least a quarter of its share, so the chunk grows from there and its next steps correct p
            high = extra <= self.flat_fixed_s
            self.flat_fixed_s = min(self.flat_fixed_s, extra)
            per = (extra / 4 if high else extra - self.flat_fixed_s) / n
            # a token's cost from long chunks only, weighted by their tokens: a short chunk's noise
            # over its few tokens (a prompt's 64-token last chunk, 76 ms on the H200) read as a
            # costly token cut the next prompts to 128-token chunks where 512 cost the same 34-44 ms
            if n >= LONG:
                w = min(MAX_WEIGHT, EMA * n / LONG)
                self.flat_token_s = per if self.flat_token_s is None else (1 - w) * self.flat_token_s + w * per

    def _flat_tokens(self) -> int:
        if self.flat_fixed_s is None:
            return MIN_TOKENS  # F first
        if self.flat_token_s is None:
            return LONG  # then one probe for p
        d, s, F = self.decode_s, self.stall, self.flat_fixed_s
        p = max(self.flat_token_s, 1e-7)
        room = HEADROOM * (s - 1) * d
        # within the bound, and at least the tokens whose work is F (no step mostly overhead); where F
        # alone takes the room, few long steps instead
        n = max(room - F, F) / p if F < room else (s - 1) * (d + F) / p
        return int(min(max(n, MIN_TOKENS), MAX_TOKENS))

    def tokens(self) -> int:
        """Prompt tokens for the next step (0: not measured yet)."""
        if self.flat and self.decode_s is not None:
            return self._flat_tokens()
        if self.decode_s is None or not self.token_s:
            return 0
        d, s = self.decode_s, self.stall
        if self.fixed():
            n = (s - 1) * (d + self.floor_s) / self.long_token_s
        else:
            n = HEADROOM * (s - 1) * d / self.token_s
        return int(min(max(n, MIN_TOKENS), MAX_TOKENS))

    def fixed(self) -> bool:
        """A chunk's fixed cost (the smallest chunk's less its tokens' work at
        a long chunk's per-token cost) is most of the smallest chunk's cost
        and over half the room the bound leaves: small chunks would stall
        nearly as long as large ones. (Late in a long prompt on a CPU a token
        costs more than a long chunk's average, by attention: that excess is
        under FIXED of the smallest chunk's cost, a GPU's host time over 0.9.)"""
        if self.floor_s is None or not self.long_token_s:
            return False
        room = (self.stall - 1) * self.decode_s
        c = self.floor_s - MIN_TOKENS * self.long_token_s
        return c > FIXED * self.floor_s and c > room / 2


PROBE = 4  # steps a micro-batch mode is timed for when tried (after the one that switches to it)
REPROBE = 256  # steps of a row count between tries of the mode not in use (speeds move: load, lengths)


def _bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()  # row counts 3-4, 5-8, ... share their timings


class MicroParts:
    """`serve --micro-batches M` (pipeline stages): whether a step runs its
    rows in M micro-batches or whole, by the steps' own times, per row count
    (a power-of-two bucket). Each mode is tried for PROBE steps, the one of
    fewer seconds a row kept, the other tried again every REPROBE steps of
    that count. Micro-batches pay where the stages run their parts at once
    and cost a split step where they cannot (MLX's CPU backend; two stages
    on one GPU: 0.62x at 16 clients, docs/benchmarks.md), so a server never
    stays on the slower one. Rank 0 decides; the step carries it (wire.Step.micro)."""

    def __init__(self, parts: int):
        self.parts = parts
        self.per_row: dict = {}  # (bucket, mode) -> seconds a row of a step, moving average
        self.use: dict = {}  # bucket -> the mode kept (1: whole steps)
        self.trial: dict = {}  # bucket -> [mode, steps still to time, steps in a row that ran the other mode]
        self.since: dict = {}  # bucket -> steps since its last trial ended
        self.last = 1  # the mode of the step decided last
        self.settled = False  # ... and of the one before it (a switch's first step reads the last mode's)
        self.verdict = None  # (bucket, {mode: seconds a row}) when a trial has just ended (the step log's)

    def choose(self, rows: int) -> int:
        """The next step's micro-batches (1: whole)."""
        mode = 1
        if self.parts > 1 and rows:
            b = _bucket(rows)
            if b not in self.trial:
                untried = [m for m in (1, self.parts) if (b, m) not in self.per_row]
                if untried or self.since.get(b, 0) >= REPROBE:
                    m = untried[0] if untried else self.parts if self.use.get(b, 1) == 1 else 1
                    self.per_row.pop((b, m), None)  # timed afresh
                    self.trial[b] = [m, PROBE, 0]
            mode = self.trial[b][0] if b in self.trial else self.use.get(b, 1)
        self.settled, self.last = mode == self.last, mode
        return mode

    def observe(self, seconds: float, rows: int, prefilled: int, traced: bool, micro: bool) -> None:
        """The step decided last, as it ran (`micro`: it launched micro-batches).
        Only a plain step of rows after one of the same mode is a measure; a
        trial of parts whose PROBE steps in a row all ran whole (a constrained
        row, a one-row buffer; a step that launched nothing, at the end of
        requests, reads the same) ends at whole steps: they cannot run."""
        self.verdict = None
        if self.parts <= 1 or not rows or prefilled or traced or not self.settled:
            return
        b, mode = _bucket(rows), self.parts if micro else 1
        trial = self.trial.get(b)
        if trial is not None and trial[0] == self.last:
            trial[2] = trial[2] + 1 if mode != self.last else 0
            if trial[2] >= PROBE:
                self.per_row[(b, self.last)] = float("inf")
                self._end_trial(b)
                return
        if mode != self.last:
            return
        key = (b, mode)
        per = seconds / rows
        self.per_row[key] = per if key not in self.per_row else (1 - EMA) * self.per_row[key] + EMA * per
        if trial is None:
            self.since[b] = self.since.get(b, 0) + 1
        elif trial[0] == mode:
            trial[1] -= 1
            if trial[1] <= 0:
                self._end_trial(b)

    def _end_trial(self, b: int) -> None:
        """Keep the mode of fewer seconds a row for row count `b` (`verdict` says which)."""
        del self.trial[b]
        self.since[b] = 0
        timed = {m: self.per_row[(b, m)] for m in (1, self.parts) if (b, m) in self.per_row}
        self.use[b] = min(timed, key=timed.get)
        self.verdict = (b, timed)
