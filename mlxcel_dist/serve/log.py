"""serve's log: one line per event on stderr, written whole (never interleaved)."""

import sys
import threading

_lock = threading.Lock()


def log(message: str) -> None:
    line = "serve: " + " ".join(str(message).split("\n")) + "\n"
    with _lock:
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stderr must not take a request down
            pass
