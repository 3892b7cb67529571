"""`GET /metrics`: the server's counters in Prometheus' text format (0.0.4),
with vLLM's meanings (its `vllm:` names here under `mlxcel_dist_`).

Rank 0's scheduler records (on its own thread) what its rows do; the HTTP
thread renders. Times are taken when the loop reads a row's ids (one engine
step, before the next sync's agreement verdict sends them out).
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

PREFIX = "mlxcel_dist_"
RATE_S = 5  # the cluster panel's tokens/s: over this many whole seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # vLLM's
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # vLLM's
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # vLLM's


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: over every bound (+Inf only)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        total += self.counts[-1]
        out += [f'{name}_bucket{{le="+Inf"}} {total}', f"{name}_sum {self.sum}", f"{name}_count {total}"]
        return out


class Metrics:
    """Counters and histograms of rank 0's requests (thread-safe)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.lock = threading.Lock()
        self.finished: dict[str, int] = {}  # finish reason ("stop", "length", "error", "abort") -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.seconds = collections.deque()  # [second, tokens generated in it] of the last RATE_S seconds
        self.spec = [0, 0, 0]  # drafts: verifies of a row with drafts, tokens drafted, drafts accepted

    def drafted(self, drafts: int, tokens: int, accepted: int) -> None:
        with self.lock:
            self.spec = [self.spec[0] + drafts, self.spec[1] + tokens, self.spec[2] + accepted]

    def admitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens

    def token(self, since: float, first: bool, share: int = 1) -> None:
        """A generated token read now; `since`: the request's arrival (first
        token) or the row's previous step. `share`: the tokens that step gave
        the row (drafts accepted): each takes its part of the gap, so the
        histogram's mean stays the time a token."""
        with self.lock:
            self.generation_tokens += 1
            now = self.clock()
            (self.ttft if first else self.tpot).observe((now - since) / (1 if first else share))
            sec = int(now)
            if self.seconds and self.seconds[-1][0] == sec:
                self.seconds[-1][1] += 1
            else:
                self.seconds.append([sec, 1])
                while self.seconds[0][0] <= sec - RATE_S:
                    self.seconds.popleft()

    def rate(self) -> float:
        """Generated tokens a second over the last RATE_S whole seconds (all rows together)."""
        with self.lock:
            now = int(self.clock())
            return sum(n for sec, n in self.seconds if now - RATE_S <= sec < now) / RATE_S

    def ended(self, reason: str, arrived: float | None) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if arrived is not None:
                self.e2e.observe(self.clock() - arrived)

    def render(self, running: int, waiting: int) -> str:
        p = PREFIX
        with self.lock:
            lines = [
                f"# HELP {p}num_requests_running Requests holding a row of the batch.",
                f"# TYPE {p}num_requests_running gauge", f"{p}num_requests_running {running}",
                f"# HELP {p}num_requests_waiting Requests queued for a row.",
                f"# TYPE {p}num_requests_waiting gauge", f"{p}num_requests_waiting {waiting}",
                f"# HELP {p}prompt_tokens_total Prompt tokens of the admitted requests.",
                f"# TYPE {p}prompt_tokens_total counter", f"{p}prompt_tokens_total {self.prompt_tokens}",
                f"# HELP {p}generation_tokens_total Generated tokens (those the clients are shown).",
                f"# TYPE {p}generation_tokens_total counter", f"{p}generation_tokens_total {self.generation_tokens}",
                f"# HELP {p}request_success_total Finished requests by finish reason (error: 5xx, abort: the "
                "client left).",
                f"# TYPE {p}request_success_total counter",
                *(f'{p}request_success_total{{finished_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())),
                f"# HELP {p}time_to_first_token_seconds Arrival to the first generated token.",
                f"# TYPE {p}time_to_first_token_seconds histogram", *self.ttft.lines(f"{p}time_to_first_token_seconds"),
                f"# HELP {p}time_per_output_token_seconds Between a request's consecutive generated tokens.",
                f"# TYPE {p}time_per_output_token_seconds histogram",
                *self.tpot.lines(f"{p}time_per_output_token_seconds"),
                f"# HELP {p}e2e_request_latency_seconds Arrival to the end of the request.",
                f"# TYPE {p}e2e_request_latency_seconds histogram", *self.e2e.lines(f"{p}e2e_request_latency_seconds"),
            ]
            drafts, tokens, accepted = self.spec
            lines += [
                f"# HELP {p}spec_decode_num_drafts_total Verify forwards of a row with drafts (serve --draft-model "
                "/ --prompt-lookup).",
                f"# TYPE {p}spec_decode_num_drafts_total counter", f"{p}spec_decode_num_drafts_total {drafts}",
                f"# HELP {p}spec_decode_num_draft_tokens_total Tokens drafted.",
                f"# TYPE {p}spec_decode_num_draft_tokens_total counter",
                f"{p}spec_decode_num_draft_tokens_total {tokens}",
                f"# HELP {p}spec_decode_num_accepted_tokens_total Drafted tokens the target accepted.",
                f"# TYPE {p}spec_decode_num_accepted_tokens_total counter",
                f"{p}spec_decode_num_accepted_tokens_total {accepted}",
                f"# HELP {p}spec_decode_mean_accepted_length Tokens a verify forward of a row with drafts yields "
                "(1 + accepted / drafts; 0: none yet).",
                f"# TYPE {p}spec_decode_mean_accepted_length gauge",
                f"{p}spec_decode_mean_accepted_length {1 + accepted / drafts if drafts else 0.0}",
            ]
        return "\n".join(lines) + "\n"
