"""serve's lifecycle on every rank: the engine, the link and heartbeats set
up at the same point on each rank; rank 0's HTTP thread (uvicorn), its
scheduler loop on the main thread, health, signals and the stuck-rank
watchdog; the other ranks follow the step protocol until shutdown."""

from __future__ import annotations

import gc
import logging
import os
import resource
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import UserError
from .log import log
from .pacing import STALL
from ..engine.generation import OneRowEngine
from .protocol import Link, advance, follow
from .wire import KIND_SHUTDOWN

DEFAULT_DECODE_CONCURRENCY = 32  # mlx-lm's --decode-concurrency
DEFAULT_PROMPT_CONCURRENCY = 8  # mlx-lm's --prompt-concurrency
DEFAULT_PROMPT_CACHE_SIZE = 10  # mlx-lm's --prompt-cache-size
SHUTDOWN_WAIT_S = 10.0  # at shutdown, how long open connections get to finish
HEADER_TIMEOUT_S = 10.0  # a connection must send a request's headers within this (serve --header-timeout)
KEEP_ALIVE_S = 5.0
BEAT_S = 0.5  # a follower's heartbeat to rank 0
MISSED_S = 3.0  # /health says 503 once a rank has been silent this long
STUCK_HEALTH_S = 5.0  # ... or an engine step has run this long (and 20 of its usual time)
# After SIGTERM, the scheduler is judged stuck in a collective of a dead rank
# when its current step had already run max(STUCK_S, STUCK_STEPS x its recent
# step time) when the signal came (mpirun sends SIGTERM ~0.25 s after a rank
# dies and SIGKILL ~0.25 s later: this must be quick), or runs on for
# max(STUCK_LATE_S, 10 x STUCK_STEPS x the step time) after it.
STUCK_S = 0.1
STUCK_STEPS = 4
STUCK_LATE_S = 1.0
# Rank 0 looks this often for a rank whose host channel closed (its process
# died): its open requests are answered before the launcher or mpirun's SIGTERM
# (and mpirun's SIGKILL soon after) reaches rank 0.
GONE_POLL_S = 0.05

# MLX CUDA's caches (CUDA graphs, cuDNN SDPA and conv plans) are LRUs whose
# "Cache thrashing" check throws once a process has ever missed more than twice
# their capacity (a lifetime count): a long-lived server meets new batch sizes
# and prompt shapes for as long as it runs, and the throw would end it with
# every open request. The CUDA graph LRU at 2000: on one H200 host serve
# --warmup's steady decode was 30-40% slower at 400 and not at 2000
# (docs/benchmarks-log.md). A value the user sets wins. MLX reads them at its
# first GPU evaluation, so the serve command sets them before anything else.
LONG_LIVED_ENV = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0", "MLX_CUDA_GRAPH_CACHE_SIZE": "2000"}


def long_lived_env() -> dict:
    """Set serve's MLX environment defaults in this process (the launcher's
    ranks inherit them); returns what is now in effect."""
    for k, v in LONG_LIVED_ENV.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in LONG_LIVED_ENV}


def listen(host: str, port: int) -> socket.socket:
    """Rank 0, before the model loads: bind the port (a port in use fails in
    seconds, before any rank waits on rank 0); connections queue meanwhile."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(4096)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


@dataclass
class Options:
    """serve's flags, as every rank needs them."""

    max_tokens_cap: int = 4096
    max_request_bytes: int = 1_000_000
    defaults: object = None  # openai_schema.Defaults
    decode_concurrency: int = DEFAULT_DECODE_CONCURRENCY
    prompt_concurrency: int = DEFAULT_PROMPT_CONCURRENCY
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE
    prompt_cache_bytes: int | None = None
    prefill_step: int | None = None
    max_num_batched_tokens: int | None = None  # None: paced (serve.pacing), prefill.default_budget() until measured
    max_stall: float = STALL  # --max-stall: the pacing's bound on a running stream's gap (serve.pacing)
    warmup: bool = False
    micro_batches: int = 1  # --micro-batches: each step's rows in that many parts (pipeline stages)
    served_names: list = field(default_factory=list)  # vLLM's --served-model-name: the first is the id shown
    header_timeout_s: float = HEADER_TIMEOUT_S
    tool_call_parser: str | None = None  # --tool-call-parser (serve.tools.FORMATS); None: from the chat template
    reasoning_parser: str | None = None  # --reasoning-parser (serve.reasoning.FORMATS or "none"); None: from it too
    draft_model: str | None = None  # --draft-model: drafts verified in the batched steps (batch_spec.py)
    prompt_lookup: bool = False  # --prompt-lookup: drafts from the rows' own ids
    num_draft_tokens: int = 3
    dtype: str | None = None  # the draft model's (--dtype)


def batchable(model) -> bool:
    """Models with their own generation loop (`own_loop`: generate_ids) are served one
    request at a time, through OneRowEngine; every other model through BatchEngine."""
    return not model.own_loop


def make_engine(model, group, opts: Options, eos_ids, tokenizer_json=None):
    """`tokenizer_json`: the tokenizer.json constrained rows' grammars match
    against (grammar.Vocab, built at the first such request)."""
    if not batchable(model):
        return OneRowEngine(model, group, eos_ids)
    from ..engine.batch import BatchEngine
    from ..engine.batch_spec import serve_drafts
    from ..engine.guard import vocab_size
    from ..engine.grammar import Vocab
    from ..engine.prompt_cache import DEFAULT_MAX_BYTES, PromptCache

    size, limit = opts.prompt_cache_size, opts.prompt_cache_bytes
    pc = PromptCache(size, DEFAULT_MAX_BYTES if limit is None else limit) if size else None
    vocab = Vocab(tokenizer_json, vocab_size(model), eos_ids) if tokenizer_json else None
    spec = serve_drafts(opts.num_draft_tokens, opts.draft_model, opts.prompt_lookup, opts.dtype, opts.prefill_step,
                        log if group.is_root else None)
    from ..engine.prefill import Budget, default_budget

    budget = Budget(opts.max_num_batched_tokens) if opts.max_num_batched_tokens else default_budget()
    return BatchEngine(model, opts.prefill_step, prompt_cache=pc, micro=opts.micro_batches, vocab=vocab, spec=spec,
                       budget=budget)


def memory() -> dict:
    """This process's memory: MLX's active and peak bytes, the resident set."""
    import mlx.core as mx

    rss = None
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # no /proc (macOS): the peak resident set
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = peak if os.uname().sysname == "Darwin" else peak * 1024
    return {"active": int(mx.get_active_memory()), "peak": int(mx.get_peak_memory()), "rss": rss}


class Beats:
    """Every rank's heartbeat to rank 0 (UDP, beside the host channel), so
    rank 0's /health knows a silent rank (stopped, or dead before the
    launcher has noticed); each beat also carries the rank's host and
    memory (`memory()`), for GET /v1/cluster. Built by every rank at the same
    point."""

    def __init__(self, monitor=None):
        self.monitor = monitor

    @classmethod
    def open(cls, group, link: Link) -> "Beats":
        from ..cluster.watchdog import HeartbeatMonitor

        if group.single or link.channel is None:  # without the channel, rank 0 has no address for beats
            return cls()
        if group.is_root:
            monitor = HeartbeatMonitor(bind_host=link.channel.local_address())
            blob = f"{monitor.port} {monitor.token}".encode()
            group.broadcast(np.frombuffer(blob.ljust(64), np.uint8).astype(np.int32))
            return cls(monitor)
        port, token = bytes(group.broadcast(None, (64,)).astype(np.uint8)).decode().split()
        addr = (link.channel.root_address(), int(port))
        head = f"{token} {group.rank()} {os.getpid()} {socket.gethostname().split()[0][:64] or '-'}"

        def beat():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                while True:
                    m = memory()
                    message = f"{head} {m['active']} {m['peak']} {m['rss'] if m['rss'] is not None else -1}"
                    try:
                        s.sendto(message.encode(), addr)
                    except OSError:
                        pass
                    time.sleep(BEAT_S)

        threading.Thread(target=beat, name="serve-heartbeat", daemon=True).start()
        return cls()

    def ranks(self) -> dict:
        """rank -> what its last beat said: host, memory, seconds since (followers only)."""
        if self.monitor is None:
            return {}
        out, now = {}, time.monotonic()
        for rank, info in list(self.monitor.info.items()):
            try:
                active, peak, rss = (int(x) for x in info[1:4])
            except (ValueError, IndexError):
                continue
            out[rank] = {"host": info[0], "pid": self.monitor.pids.get(rank),
                         "memory": {"active": active, "peak": peak, "rss": None if rss < 0 else rss},
                         "last_seen_s": round(now - self.monitor.last.get(rank, now), 2)}
        return out

    def silent(self, n_ranks: int) -> tuple[int, float] | None:
        if self.monitor is None:
            return None
        self.monitor.last[0] = time.monotonic()
        return self.monitor.stalled(n_ranks, MISSED_S)


class Health:
    """What /health says: ok, or the reason it is not."""

    def __init__(self, scheduler, beats: Beats, n_ranks: int):
        self.scheduler, self.beats, self.n_ranks = scheduler, beats, n_ranks

    def status(self) -> tuple[bool, str]:
        s = self.scheduler
        if s.stopping.is_set():
            return False, "shutting down"
        silent = self.beats.silent(self.n_ranks)
        if silent is not None:
            return False, f"rank {silent[0]} has not been heard from for {silent[1]:.1f} s"
        busy = s.busy_since
        if busy is not None:
            ran = time.monotonic() - busy
            if ran > max(STUCK_HEALTH_S, 20 * s.step_s):
                return False, f"the engine step has run for {ran:.1f} s (a rank is slow or not responding)"
        return True, ""


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides; its shutdown note ends the loop
        try:
            signal.signal(sig, lambda *_: None)
        except ValueError:  # pragma: no cover - not the main thread
            pass


def run(model, tok, group, opts: Options, sock: socket.socket | None = None, config: dict | None = None) -> None:
    """Every rank: set up at the same points, then serve (rank 0) or follow."""
    from ..engine.guard import RankAgreement

    engine = make_engine(model, group, opts, tok.eos_ids, tok.model_dir / "tokenizer.json")
    vocab = getattr(engine, "vocab", None)
    if vocab is not None and vocab.available():
        # llguidance's view of the vocabulary takes seconds for 150k tokens: built before the
        # first constrained request needs it (that request's step would wait for it)
        threading.Thread(target=_build_vocab, args=(vocab, group.is_root), name="serve-grammar-vocab",
                         daemon=True).start()
    link = Link.open(group)
    if link.channel is None and not group.single and group.is_root:
        log("no host channel to every rank (TCP to rank 0 refused or unreachable): step control goes through "
            "device collectives (they wait behind the step in flight, and idle ranks wait inside one)")
    beats = Beats.open(group, link)
    guard = RankAgreement(group, every=0)
    if opts.warmup and batchable(model):
        t = time.monotonic()
        done = engine.warmup(opts.decode_concurrency)
        if group.is_root:
            log(f"batch steps ready for 1-{done[-1][0]} rows in {time.monotonic() - t:.1f} s "
                f"({', '.join(f'{c}: {s:.1f}' for c, s in done)})")
    if not group.is_root:
        _ignore_signals()
        try:
            follow(engine, link, guard)
        finally:
            link.close()
        log(f"rank {group.rank()} stopped")
        return
    _serve(model, tok, group, opts, sock, config, engine, link, beats, guard)


def _build_vocab(vocab, root: bool) -> None:
    try:
        vocab.tokenizer()
    except Exception as e:  # noqa: BLE001 - reported; a constrained request then fails with it (500)
        if root:
            log(f"constrained decoding unavailable: llguidance cannot read {vocab.path}: {type(e).__name__}: {e}")


def _grammar_refusal(one_row: bool) -> str | None:
    """Why this server cannot constrain decoding (None: it can)."""
    from ..engine import grammar

    if one_row:
        return "this model runs its own generation loop"
    if not grammar.available():
        return f"llguidance is not installed ({grammar.INSTALL_HINT})"
    return None


def _serve(model, tok, group, opts, sock, config, engine, link, beats, guard) -> None:
    import uvicorn

    from . import openai_api as api
    from . import openai_schema as schema
    from . import responses as rs
    from .app import AppState, make_app
    from .scheduler import Scheduler

    one_row = not batchable(model)
    sched = Scheduler(tok, 1 if one_row else opts.decode_concurrency, 1 if one_row else opts.prompt_concurrency,
                      sleeping_followers=group.single or link.channel is not None,
                      pace=None if one_row or opts.max_num_batched_tokens else opts.max_stall,
                      micro=1 if one_row else opts.micro_batches)
    ctx = schema.ParseContext(tokenizer=tok, vocab_size=model.args.vocab_size, model_ids=tuple(opts.served_names),
                           max_tokens_cap=opts.max_tokens_cap, context_length=api.context_limit(config),
                           defaults=opts.defaults or schema.Defaults(), plain_chat=api.no_chat_template(tok),
                           logprobs_ok=not one_row, ignore_eos_ok=not one_row, grammar_refusal=_grammar_refusal(one_row),
                           max_n=1 if one_row else min(schema.MAX_N, opts.decode_concurrency),
                           **_template_formats(tok, opts.tool_call_parser, opts.reasoning_parser))
    health = Health(sched, beats, group.size())
    stage = model.stage
    state = AppState(sched, ctx, rs.TokenPieces(tok), health, opts.max_request_bytes, int(time.time()),
                     cluster=_cluster_status(sched, engine, group, link, beats, health, ctx.model_ids[0],
                                             stage.P if stage is not None else 1, opts.decode_concurrency))
    _raise_fd_limit()
    _route_uvicorn_logs()
    server = uvicorn.Server(uvicorn.Config(
        make_app(state), http=_guarded_h11(opts.header_timeout_s), lifespan="off", log_config=None, access_log=False, ws="none",
        timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=SHUTDOWN_WAIT_S))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="serve-http", daemon=True)
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    saved = {sig: signal.signal(sig, lambda *_: sched.stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    saved_fd = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    loop_done = threading.Event()
    threading.Thread(target=_watch_signals, args=(sched, rfd, loop_done), daemon=True).start()
    if link.channel is not None:
        threading.Thread(target=_watch_ranks, args=(sched, link.channel, loop_done), daemon=True).start()
    try:
        http.start()
        h, p = sock.getsockname()[:2]
        if ctx.plain_chat:
            log(f"{ctx.model_ids[0]} has no chat template: chat requests are rendered as plain "
                "'USER: ... ASSISTANT:' text (as mlx-lm's server)")
        stage = model.stage
        pp = f", pp {stage.P}" if stage is not None else ""
        log(f"{ctx.model_ids[0]} on http://{h}:{p}/v1 (np {group.size()}{pp})")
        spec = getattr(engine, "spec", None)
        if spec is not None:
            log(f"drafts: {spec.name}, {spec.k} a step (a request opts out with \"speculative\": false)")
        _loop(sched, engine, link, guard)
    finally:
        loop_done.set()
        server.should_exit = True
        http.join(SHUTDOWN_WAIT_S + 2)
        signal.set_wakeup_fd(saved_fd)
        for sig, old in saved.items():
            signal.signal(sig, old)
        log("stopped")


def _cluster_status(sched, engine, group, link, beats, health, model: str, pp: int, capacity: int):
    """GET /v1/cluster's answer, built when asked: what rank 0 knows of the job
    (its scheduler and metrics, its own memory, the other ranks' from their
    heartbeats: none without the host channel)."""
    from ..parallel.distributed import ENV_BACKEND

    started, host = time.monotonic(), socket.gethostname()

    def status() -> dict:
        ok, reason = health.status()
        heard = beats.ranks()
        ranks = [{"rank": 0, "host": host, "pid": os.getpid(), "memory": memory(), "last_seen_s": 0.0}]
        for r in range(1, group.size()):
            ranks.append({"rank": r, **heard.get(r, {"host": None, "pid": None, "memory": None,
                                                      "last_seen_s": None})})
        m = sched.metrics
        return {"model": model, "backend": os.environ.get(ENV_BACKEND) or ("single" if group.single else None),
                "np": group.size(), "pp": pp, "host_channel": link.channel is not None,
                "health": {"ok": ok, "reason": reason or None}, "uptime_s": round(time.monotonic() - started, 1),
                "ranks": ranks,
                "rows": {"active": sched.active, "waiting": sched.waiting, "capacity": capacity},
                "tokens_per_s": m.rate(),
                "tokens": {"prompt": m.prompt_tokens, "prefilled": getattr(engine, "prefilled", None),
                           "generated": m.generation_tokens},
                "requests": dict(m.finished)}

    return status


REPORT_S = 15.0  # under MLXCEL_DIST_STEP_LOG, the loop's interval report every this many seconds


class _Report:
    """Under MLXCEL_DIST_STEP_LOG, a line every REPORT_S seconds of serving:
    the loop's times per step since the last line, the process's CPU, MLX's
    memory, the engine's buffers, the garbage collector's time and the live
    objects: what grows when a server slows over its life."""

    def __init__(self, sched, engine):
        self.sched, self.engine = sched, engine
        self.gc_s, self.full, self._gc_t = 0.0, 0, 0.0
        self._mark()
        gc.callbacks.append(self._gc)

    def _clock(self) -> dict:
        clock = getattr(self.engine, "host_clock", None)  # the batch engine's parts (an own-loop engine: none)
        return clock() if clock is not None else {}

    def _mark(self) -> None:
        self.t, self.cpu, self.before = time.monotonic(), time.process_time(), replace(self.sched.times)
        self.thread_cpu, self.clock = time.thread_time(), self._clock()
        self.gc_s, self.full = 0.0, 0

    def _parts(self, steps: int) -> str:
        """The engine's host time a step by part (batch_step.Steps.clock) since the last line."""
        now = self._clock()
        if not now:
            return ""
        d = {k: now[k] - self.clock.get(k, 0.0) for k in now}
        ms = {k: 1e3 * v / max(steps, 1) for k, v in d.items() if k != "deferred"}
        rows = d["deferred"] / max(steps, 1)  # (a count of rows, not seconds)
        ahead = f" (their worker's start {ms['start']:.2f}, compute {ms['compute']:.2f})" if "start" in d else ""
        return (f" (launch {ms['launch']:.2f} (MLX's start {ms['eval']:.2f}), grammar masks' wait {ms['masks']:.2f}"
                f"{ahead}, upload {ms['upload']:.2f}, their draw {ms['draw']:.2f}, read {ms['read']:.2f}; "
                f"{rows:.1f} constrained rows a step)")

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t
            self.full += info.get("generation") == 2

    def __call__(self) -> None:
        dt = time.monotonic() - self.t
        if dt < REPORT_S or self.sched.times.steps == self.before.steps:
            return
        import mlx.core as mx

        store = getattr(self.engine, "store", None)
        buffers = f"buffers {store.capacity()} rows x {store.slots()} slots, " if store is not None else ""
        steps = self.sched.times.steps - self.before.steps
        log(f"last {dt:.0f} s: {self.sched.times.since(self.before)}{self._parts(steps)}; CPU "
            f"{(time.process_time() - self.cpu) / dt:.2f} s a second (this thread "
            f"{(time.thread_time() - self.thread_cpu) / dt:.2f}); {buffers}MLX active "
            f"{mx.get_active_memory() / 1e9:.2f} GB, cache {mx.get_cache_memory() / 1e9:.2f} GB; "
            f"GC {1e3 * self.gc_s:.0f} ms ({self.full} full), {len(gc.get_objects())} objects")
        self._mark()

    def close(self) -> None:
        gc.callbacks.remove(self._gc)


def _loop(sched, engine, link, guard) -> None:
    """Rank 0's main thread: plan, advance every rank, absorb, until shutdown."""
    from ..engine.guard import RanksDiverged
    from .scheduler import SHUTDOWN_MESSAGE, STEP_LOG

    def busy(t):
        sched.busy_since = t

    def agreed():
        sched.synced(time.monotonic() - t_sync)
        sched.deliver()

    report = _Report(sched, engine) if STEP_LOG else None
    try:
        while True:
            step = sched.plan()
            t_sync = sched.busy_since = time.monotonic()  # the sync waits on every rank: a stopped one sticks here
            step, result = advance(engine, link, guard, step, keep_logprobs=True, agreed=agreed, busy=busy)
            sched.busy_since = None  # (an idle note or shutdown has no engine step to clear it)
            if step.kind == KIND_SHUTDOWN:
                return
            sched.absorb(step, result)
            if report is not None:
                report()
    except RanksDiverged as e:  # raised on every rank: they have all left
        sched.fail_all(str(e), 500)
        raise
    except BaseException as e:  # the server goes down; every waiting client still gets an answer
        sched.fail_all(f"generation failed: {type(e).__name__}: {e}", 500)
        log(f"rank 0 failed: {type(e).__name__}: {e}")
        raise
    finally:
        sched.busy_since = None
        if report is not None:
            report.close()
        if sched.times.steps:
            log(str(sched.times))
        link.close()
        sched.fail_all(SHUTDOWN_MESSAGE, 503)  # whatever is still queued: answered, not dropped


def _watch_signals(sched, rfd: int, loop_done: threading.Event) -> None:
    """The main thread may sit in a collective of a dead rank (C code), where
    Python handlers never run; the C-level handler still writes the signal's
    number to the wakeup fd, read here: stop, and if the loop is stuck, answer
    every open request and end the process."""
    from .scheduler import SHUTDOWN_MESSAGE

    while True:
        try:
            data = os.read(rfd, 64)
        except OSError:  # pragma: no cover
            return
        if not data:
            return
        if not any(b in (signal.SIGINT, signal.SIGTERM) for b in data):
            continue
        busy = sched.busy_since
        sched.stop()
        now = time.monotonic()
        stuck = busy is not None and now - busy > max(STUCK_S, STUCK_STEPS * sched.step_s)
        while not stuck and not loop_done.wait(0.01):
            busy = sched.busy_since
            stuck = busy is not None and time.monotonic() - max(busy, now) > max(STUCK_LATE_S,
                                                                                 10 * STUCK_STEPS * sched.step_s)
        if not stuck:
            return
        n = sched.fail_all(f"{SHUTDOWN_MESSAGE}: the ranks did not stop (a rank has failed or is not responding)",
                           503)
        if loop_done.wait(STUCK_LATE_S):  # only slow after all: the main thread ends the job as usual
            return
        time.sleep(0.5)  # the HTTP thread writes the answers
        log(f"rank 0 stopped without the other ranks ({n} open request(s) answered with an error)")
        os._exit(1)


def _watch_ranks(sched, channel, loop_done: threading.Event) -> None:
    """A rank's process died: answer every open request with an error now.
    The loop will be stuck in (or fail out of) a collective with it, and
    rank 0 is stopped soon after, by the launcher or by mpirun, whose SIGKILL
    follows its SIGTERM by a fraction of a second."""
    while not loop_done.wait(GONE_POLL_S):
        gone = channel.gone()
        if gone and not loop_done.is_set() and not sched.stopping.is_set():
            n = sched.fail_all(f"rank {gone[0]} has stopped (its process ended); the server is going down", 503)
            log(f"rank {gone[0]} has stopped: {n} open request(s) answered with an error")
            return


def _raise_fd_limit() -> None:
    """Idle connections cost a descriptor each: allow as many as the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
        except (ValueError, OSError):
            pass


class _LogHandler(logging.Handler):
    def emit(self, record):
        text = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:  # a bug of ours: its traceback, in one write
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        log(text)


def _route_uvicorn_logs() -> None:
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers = [_LogHandler()]
        lg.setLevel(logging.WARNING)
        lg.propagate = False


def _template_formats(tok, tool_parser: str | None, reasoning_parser: str | None) -> dict:
    """ParseContext's fields read from the chat template: the tool-call format
    (--tool-call-parser, else the template's; None: no tools), the reasoning
    form (--reasoning-parser, else the template's; "none": off) and the
    variables it reads."""
    from . import reasoning, tools

    try:
        source, _ = tok.chat_template()
    except Exception:  # noqa: BLE001 - no template: no tools, no reasoning
        source = None
    think = reasoning.detect(source) if reasoning_parser is None else reasoning_parser
    think = None if think == "none" else think
    fmt = tool_parser if tool_parser is not None else tools.detect(source)
    markers = ([reasoning.CLOSE] if think in ("qwen3", "deepseek_r1") else []) + ([tools.START[fmt]] if fmt else [])
    return {"tool_format": fmt, "reasoning_format": think, "template_vars": reasoning.template_vars(source),
            "keep_special": any(_vanishes(tok, m) for m in markers)}


def _vanishes(tok, marker: str) -> bool:
    """A marker that is a special token of this vocabulary (decoding drops it)."""
    try:
        return tok.decode(tok.encode(marker, add_special_tokens=False)) != marker
    except Exception:  # noqa: BLE001 - a tokenizer that cannot take it: nothing to keep
        return False


def _guarded_h11(header_timeout_s: float = HEADER_TIMEOUT_S):
    """uvicorn's h11 protocol with a header timeout: a connection that has
    not sent a whole request head within header_timeout_s (at its start, or
    after a response) is closed; uvicorn alone waits for it forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        def _arm(self):
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def _head_timeout(self):
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    return Guarded
