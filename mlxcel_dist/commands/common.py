"""What the commands share: the one-line error report, rank 0's stderr lines,
MODEL or --model, and the checks of files and text from the command line."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ..parallel.collectives import CollectiveError
from ..errors import UserError

COLLECTIVE_ERROR_GRACE_S = 2.0  # other ranks wait this long before exiting on a CollectiveError


def handle_errors(fn):
    """A `UserError` as one `error:` line and its exit code; Ctrl-C as 130."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            if isinstance(e, CollectiveError) and _is_other_rank():
                # Every rank raised it; rank 0 reports. Leave it the time to:
                # mpirun stops the whole job at the first rank that exits.
                import time

                time.sleep(COLLECTIVE_ERROR_GRACE_S)
            else:
                err(f"error: {e}")
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _is_other_rank() -> bool:
    """A launched rank other than 0 (errors every rank raises alike are
    reported by rank 0 alone)."""
    if not os.environ.get("MLXCEL_DIST_WORLD"):
        return False
    from ..parallel import distributed

    return not distributed.world().is_root


def err(msg: str) -> None:
    """A line for stderr. Rank 0 under a launcher whose command relays
    stdout and stderr separately (mpirun, which can reorder them) sends it
    along its stdout, marked, and the launcher puts it on stderr in order
    (distributed.REPORT_MARKER)."""
    if os.environ.get("MLXCEL_DIST_REPORTS_ON_STDOUT") == "1":
        from ..parallel import distributed

        if distributed.world().is_root:
            sys.stdout.write(f"{distributed.REPORT_MARKER}{msg}\n")
            sys.stdout.flush()
            return
    print(msg, file=sys.stderr, flush=True)


def pick_model(model: Optional[str], model_opt: Optional[str]) -> Optional[str]:
    """MODEL or --model (mlx-lm's spelling); both only when they agree."""
    if model is not None and model_opt is not None and model != model_opt:
        raise UserError(f"MODEL {model!r} and --model {model_opt!r} differ: give one")
    return model if model is not None else model_opt


def check_out(out: Path) -> None:
    """An output file's folder must exist and be writable before any work."""
    parent = out.expanduser().resolve().parent
    if not parent.is_dir():
        raise UserError(f"cannot write {out}: no such directory {parent}")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {out}: {parent} is not writable")


def read_tokens(path: Path):
    """--tokens-file: a 1-D integer .npy."""
    import numpy as np

    if not path.exists():
        raise UserError(f"{path}: no such tokens file")
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not a .npy array ({e})") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"{path}: expected a 1-D integer array, got {ids.dtype} {list(ids.shape)}")
    return ids


def pp_note(pp: int, model=None) -> str:
    """", pp P" and, given the loaded model, each stage's layers."""
    if pp <= 1:
        return ""
    stage = model.stage if model is not None else None
    spans = " ".join(f"[{a}, {b})" for a, b in stage.ranges) if stage is not None else ""
    return f", pp {pp}" + (f": layers {spans}" if spans else "")
