"""How many prompt tokens each step prefills beside the decoding rows
(rank 0's scheduler decides, the step carries it to every rank).

A mixed step costs the rows' decode plus the prompt chunk, and a running
stream's gap between tokens is that step. `Pacer` keeps two moving averages
from the steps it is told of: a step with decoding rows and no prefill (d),
and a prompt token's cost inside a step (p, the step's time less d, per
token prefilled). It then gives prompts (STALL - 1) x d / p tokens a step, so
a stream's gap stays within STALL x its plain gap while the prompts get what
is left. On a device where a prompt token costs about a decode row's token
(a CPU) that is a share of the work; where the decode step is bound by
reading weights (a GPU), the same rule gives prompts large chunks. Until both
averages are known it answers 0: the engine's own `prefill.Budget` applies.
`serve --max-num-batched-tokens` fixes the budget instead (no pacing).
"""

from __future__ import annotations

STALL = 3.0  # a running stream's gap while prompts prefill, at most this x its plain gap (serve --max-stall)
MIN_TOKENS = 8  # prompt tokens a step at the least (prompts always move)
MAX_TOKENS = 8192
EMA = 0.2  # weight of the newest step in each average


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

    def observe(self, seconds: float, rows: int, prefilled: int) -> None:
        """One engine step: `rows` decoded an id, `prefilled` prompt tokens ran."""
        if rows and not prefilled:
            self.decode_s = seconds if self.decode_s is None else (1 - EMA) * self.decode_s + EMA * seconds
        elif prefilled and (self.decode_s is not None or not rows):
            per = max(seconds - (self.decode_s if rows else 0.0), 0.0) / prefilled
            self.token_s = per if self.token_s is None else (1 - EMA) * self.token_s + EMA * per

    def tokens(self) -> int:
        """Prompt tokens for the next step (0: not measured yet)."""
        if self.decode_s is None or not self.token_s:
            return 0
        return int(min(max((self.stall - 1) * self.decode_s / self.token_s, MIN_TOKENS), MAX_TOKENS))
