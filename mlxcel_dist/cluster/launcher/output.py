"""The launcher's output: rank lines copied to our stderr a whole line at a
time (prefixed, MLX's peer-loss noise dropped unless --verbose), rank 0's
stdout relayed through a command with its marked report lines sent to our
stderr, and the launcher's own lines (``_say``)."""

from __future__ import annotations

import os
import re
import sys
import threading

from .. import backends
from ...parallel.distributed import REPORT_MARKER


def _say(msg: str) -> None:
    """One line on the launcher's stderr."""
    try:
        sys.stderr.write(f"mlxcel-dist: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # pragma: no cover - closed stderr
        pass


_out_lock = threading.Lock()
_LINE_RE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


def _write_stream(stream, data: bytes) -> None:
    with _out_lock:
        try:
            buf = getattr(stream, "buffer", None)
            if buf is not None:
                buf.write(data)
            else:
                stream.write(data.decode("utf-8", errors="replace"))
            stream.flush()
        except (OSError, ValueError):  # pragma: no cover - closed stream
            pass


# Some of MLX's backends log every failed socket operation once a peer is
# gone ("[ring] Socket 6 was closed by the peer" x10 per rank): those whose
# class says ``logs_peer_loss``. The launcher names the rank that failed;
# these lines are shown with --verbose only.
_TRANSPORT_NOISE = re.compile(
    rb"^(?:\[rank \d+\] )?\[(?:"
    + b"|".join(re.escape(b.name.encode()) for b in backends.BACKENDS.values() if b.logs_peer_loss)
    + rb")\] "
)


def _chunks(fd: int):
    """A pipe's data as it comes, until its end (or a failed read); the pipe
    is closed then."""
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            yield chunk
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def _muted(proc) -> bool:
    return proc is not None and proc.muted


def _pump_lines(fd: int, prefix: bytes, transform=None, proc=None, show_transport: bool = False) -> None:
    """Copy a pipe to our stderr a whole line at a time (never half a line
    of one rank inside a line of another), each line prefixed. ``transform``
    (line -> bytes to write) may hold lines back or drop them."""
    pending = b""
    for chunk in _chunks(fd):
        pending += chunk
        pos = 0
        out = []
        for m in _LINE_RE.finditer(pending):
            line = prefix + m.group(0)
            pos = m.end()
            if not show_transport and _TRANSPORT_NOISE.match(line):
                continue
            out.append(transform(line) if transform is not None else line)
        pending = pending[pos:]
        data = b"".join(out)
        if data and not _muted(proc):
            _write_stream(sys.stderr, data)
    tail = prefix + pending + b"\n" if pending else b""
    if transform is not None:
        tail = (transform(tail) if tail else b"") + transform.finish()
    if tail and not _muted(proc):
        _write_stream(sys.stderr, tail)


_MARK = REPORT_MARKER.encode()


def _demux_reports(fd: int, proc=None) -> None:
    """Copy rank 0's stdout (through a command that relays it, e.g. mpirun)
    to ours as it comes, text streaming unbuffered, except lines that start
    with REPORT_MARKER: those go to our stderr, unmarked, in order."""
    held = b""  # the start of a line that may still become a marked one
    at_line_start = True
    for chunk in _chunks(fd):
        data, held = held + chunk, b""
        out, err = [], []
        while data:
            if at_line_start and (data.startswith(_MARK) or _MARK.startswith(data)):
                end = data.find(b"\n")
                if end < 0 or not data.startswith(_MARK):
                    held = data  # the marker or its line is not whole yet
                    break
                err.append(data[len(_MARK) : end + 1])
                data = data[end + 1 :]
                continue
            end = data.find(b"\n")
            piece = data if end < 0 else data[: end + 1]
            out.append(piece)
            at_line_start = end >= 0
            data = data[len(piece) :]
        if out and not _muted(proc):
            _write_stream(sys.stdout, b"".join(out))
        if err and not _muted(proc):
            _write_stream(sys.stderr, b"".join(err))
    if held and not _muted(proc):
        _write_stream(sys.stdout, held[len(_MARK):] if held.startswith(_MARK) else held)
