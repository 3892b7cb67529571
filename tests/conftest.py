"""Suite-wide guards: no test may hang the run, leak processes, or fail
without saying what state the machine was in.

- Every test's setup and call get a hard time limit (MLXCEL_TEST_TIMEOUT,
  default 600 s), and the whole run a budget (MLXCEL_TEST_BUDGET, default
  3600 s) past which it stops with a summary instead of being cut off.
  When it expires, every process this pytest started (ranks, mpirun, servers,
  whatever session they moved to) is SIGKILLed, so a blocked wait returns and
  the test fails instead of stalling CI until its own limit.
- At the end, processes the tests left behind are killed and counted.
- The first failure carries a diagnostics section (open files, threads, child
  processes, memory, disk, whether the checkout is still readable), and the
  terminal summary repeats it, so a failure on another machine tells why.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from testproc import OWNER_ENV, descendants, kill_descendants

ROOT = Path(__file__).resolve().parent.parent
TEST_TIMEOUT = float(os.environ.get("MLXCEL_TEST_TIMEOUT", "600"))
SESSION_BUDGET = float(os.environ.get("MLXCEL_TEST_BUDGET", "3600"))
_START = time.monotonic()

_state = {"first_failure": None, "leftovers": 0}

# Every process started under this pytest inherits the marker, so one that
# was orphaned (its launcher killed, reparented to init) is still found.
os.environ[OWNER_ENV] = str(os.getpid())
# One folder that both xdist workers see (made once, by the controller or a
# plain run, and inherited): reference_cases' cache of single-process logits.
_SHARED_MADE = "MLXCEL_TEST_SHARED" not in os.environ
if _SHARED_MADE:
    os.environ["MLXCEL_TEST_SHARED"] = tempfile.mkdtemp(prefix="mlxcel-tests-")


# --------------------------------------------------------------------------- #
# diagnostics
# --------------------------------------------------------------------------- #


def diagnostics() -> str:
    def count(path: str) -> str:
        try:
            return str(len(os.listdir(path)))
        except OSError as e:
            return f"? ({e.strerror})"

    lines = [
        f"open fds={count('/proc/self/fd')} threads={threading.active_count()} "
        f"(os tasks={count('/proc/self/task')}) child processes={len(descendants())}",
    ]
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)
        lines.append(f"limits: nofile={soft}/{hard} nproc={nproc[0]}/{nproc[1]}")
    except (ImportError, ValueError, OSError):
        pass
    try:
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        lines.append(f"memory: available={mem['MemAvailable'].strip()} total={mem['MemTotal'].strip()}")
    except (OSError, KeyError, ValueError):
        pass
    for p in (ROOT, Path("/tmp")):
        try:
            du = shutil.disk_usage(p)
            lines.append(f"disk {p}: {du.free / 2**30:.1f} GiB free of {du.total / 2**30:.1f}")
        except OSError as e:
            lines.append(f"disk {p}: {e}")
    probe = ROOT / "tests" / "fixtures"
    try:
        n = sum(1 for _ in probe.glob("*/*/config.json"))
        lines.append(f"checkout readable: {n} fixture configs under {probe}")
    except OSError as e:
        lines.append(f"checkout NOT readable: {e}")
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
        lines.append(f"load average: {' '.join(load)}")
    except OSError:
        pass
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# hooks
# --------------------------------------------------------------------------- #


class TestTimeout(Exception):
    pass


def _guarded(item, phase):
    """Run one phase (setup: module fixtures start TP jobs; call) under the
    hard time limit."""
    use_alarm = (
        TEST_TIMEOUT > 0
        and hasattr(signal, "SIGALRM")
        and threading.current_thread() is threading.main_thread()
    )
    if not use_alarm:
        yield
        return

    def expired(_signum, _frame):
        n = kill_descendants()
        raise TestTimeout(
            f"{item.nodeid} ({phase}) ran past {TEST_TIMEOUT:.0f} s (MLXCEL_TEST_TIMEOUT); "
            f"killed {n} child process(es)\n{diagnostics()}"
        )

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------- #
# two workers (pytest-xdist, `-n 2 --dist loadfile` in pyproject.toml)
# --------------------------------------------------------------------------- #

# A module's tests run on one worker (its module fixtures, launched jobs and
# servers, are made once). These three share the single-process logits of
# every fixture (reference_cases.mode_logits, cached on disk for both
# workers) and run first: the longest units of work.
LOGITS_FILES = ("test_pipeline.py", "test_tp.py", "test_reference.py")
# Then the next longest (durations of a whole run, 2026-12-02), so that no long
# file starts last while the other worker has nothing left to run. pyproject's
# --no-loadscope-reorder keeps this order (xdist >= 3.8 would order by test count).
LONG_FILES = ("test_serve.py", "test_decode.py", "test_grammar.py", "test_faults.py", "test_generate.py",
              "test_batch.py", "test_shardcache.py", "test_kv.py", "test_spec.py", "test_plan.py", "test_serve_pp.py",
              "test_multihost.py", "test_lora.py", "test_launcher.py", "test_serve_reasoning.py", "test_fused.py",
              "test_moe_experts.py", "test_serve_clients.py", "test_quantized.py", "test_cli.py", "test_minimax_m2.py",
              "test_qwen3_next.py", "test_serve_hostile.py", "test_mixed_step.py", "test_diffusion_gemma.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LOGITS_FILES + LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    # CI stops a run at 90 min and then shows no summary: stop earlier, with one
    elapsed = time.monotonic() - _START
    if SESSION_BUDGET > 0 and elapsed > SESSION_BUDGET:
        pytest.exit(f"the suite ran past MLXCEL_TEST_BUDGET={SESSION_BUDGET:.0f} s before "
                    f"{item.nodeid}\n{diagnostics()}", returncode=1)
    yield from _guarded(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _guarded(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _state["first_failure"] is None:
        text = diagnostics()
        _state["first_failure"] = (item.nodeid, report.when, text)
        report.sections.append(("diagnostics at the first failure", text))


def pytest_sessionfinish(session, exitstatus):
    _state["leftovers"] = kill_descendants()
    if _SHARED_MADE and not hasattr(session.config, "workerinput"):  # the process that made it, not a worker
        shutil.rmtree(os.environ["MLXCEL_TEST_SHARED"], ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if _state["leftovers"]:
        tr.write_line(f"conftest: killed {_state['leftovers']} process(es) the tests left running")
    if _state["first_failure"] is not None:
        nodeid, when, text = _state["first_failure"]
        tr.write_sep("-", f"diagnostics at the first failure ({nodeid}, {when})")
        for line in text.splitlines():
            tr.write_line(line)

