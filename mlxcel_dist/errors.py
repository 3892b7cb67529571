"""The one exception type users see.

Anything raised as `UserError` is bad input or an unusable environment: the CLI
prints its message as a single `error: ...` line and exits 2, never a traceback.
"""


class UserError(Exception):
    """Bad input (path, config, weights, hostfile, rank count, token ids, backend)."""

    exit_code = 2
