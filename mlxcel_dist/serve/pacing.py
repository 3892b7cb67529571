"""How many prompt tokens each step prefills beside the decoding rows
(rank 0's scheduler decides, the step carries it to every rank).

A mixed step costs the rows' decode plus the prompt chunk, and a running
stream's gap between tokens is that step. `Pacer` keeps a moving average of
a step with decoding rows and no prefill (d) and fits what a mixed step
costs beyond it to its prompt tokens n as c + n x p over the last WINDOW
mixed steps and the last one of LONG tokens or more (least squares): c, the chunk's forward whatever its size (on a
GPU its host time, tens of ms for a 12B model's eager forward), p, a prompt
token. It then gives prompts ((STALL - 1) x d - c) / p tokens a step, so a
stream's gap stays within STALL x its plain gap while the prompts get what
is left. Where even a small chunk breaks that bound (c alone over
(STALL - 1) x d: a GPU's fixed cost beside a short decode step), every mixed
step stalls the streams anyway, so the prompt takes chunks whose own work is
(STALL - 1) x a smallest mixed step's: few stalls, and its first token
about as soon as alone. Until d and one mixed step are known it answers 0:
the engine's own `prefill.Budget` applies. `serve --max-num-batched-tokens`
fixes the budget instead (no pacing).
"""

from __future__ import annotations

from collections import deque

STALL = 3.0  # a running stream's gap while prompts prefill, at most this x its plain gap (serve --max-stall)
MIN_TOKENS = 8  # prompt tokens a step at the least (prompts always move)
MAX_TOKENS = 8192
EMA = 0.2  # weight of the newest plain step in d
WINDOW = 16  # the mixed steps the fit of c and p reads
LONG = 128  # ... and the last step of at least this many prompt tokens (a GPU's p shows only in long chunks)


def fit(points) -> tuple[float, float]:
    """(c, p) of y = c + n x p by least squares over (n, y) points, c >= 0;
    while the chunks barely differ in size (or the slope is lost in the
    steps' noise), one of them: p = y / n, no fixed part, or the smallest
    such p where the slope came out <= 0."""
    ns, ys = [n for n, _ in points], [y for _, y in points]
    mn, my = sum(ns) / len(ns), sum(ys) / len(ys)
    var = sum((n - mn) ** 2 for n in ns)
    if len(points) < 2 or max(ns) < 1.5 * min(ns) or var == 0:
        return 0.0, max(my, 0.0) / mn
    slope = sum((n - mn) * (y - my) for n, y in points) / var
    if slope <= 0:  # the per-token cost is below the noise: the steps' cost is their fixed part
        return max(min(ys), 0.0), max(min(max(y, 0.0) / n for n, y in points), 1e-9)
    return max(my - slope * mn, 0.0), slope


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
        self.mixed: deque = deque(maxlen=WINDOW)  # (prompt tokens, the step's time beyond d)
        self.long: tuple | None = None  # the last such point of at least LONG tokens

    def observe(self, seconds: float, rows: int, prefilled: int) -> None:
        """One engine step: `rows` decoded an id, `prefilled` prompt tokens ran."""
        if rows and not prefilled:
            self.decode_s = seconds if self.decode_s is None else (1 - EMA) * self.decode_s + EMA * seconds
        elif prefilled and (self.decode_s is not None or not rows):
            point = (prefilled, seconds - (self.decode_s if rows else 0.0))
            self.mixed.append(point)
            if prefilled >= LONG:
                self.long = point

    def cost(self) -> tuple[float, float]:
        """(c, p): a mixed step's fixed cost beyond d and a prompt token's."""
        points = list(self.mixed)
        if self.long is not None and self.long not in points:
            points.append(self.long)
        return fit(points)

    def tokens(self) -> int:
        """Prompt tokens for the next step (0: not measured yet)."""
        if self.decode_s is None or not self.mixed:
            return 0
        c, p = self.cost()
        d, s = self.decode_s, self.stall
        room = (s - 1) * d - c
        if room >= MIN_TOKENS * p:
            n = room / p
        else:  # no chunk keeps the bound: a chunk's work (S - 1) x the smallest mixed step's, its
            # per-token cost the larger of the fit's and a long chunk's whole (a slope lost in noise)
            long_p = self.long[1] / self.long[0] if self.long is not None else 0.0
            n = (s - 1) * (d + c) / max(p, long_p)
        return int(min(max(n, MIN_TOKENS), MAX_TOKENS))
