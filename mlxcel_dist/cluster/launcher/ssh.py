"""Ranks on other hosts: the ssh argv that starts one (its environment and
files exported in a remote shell script), and one reachability probe per
host before anything starts."""

from __future__ import annotations

import shlex
import subprocess
import threading
from collections.abc import Mapping, Sequence

from ...errors import UserError
from ..hostfile import Host


def _remote_script(env: Mapping[str, str], files: Mapping[str, str], cmd: Sequence[str], cwd: str) -> str:
    q = shlex.quote
    parts = ["stty -echo -onlcr 2>/dev/null", f"cd {q(cwd)} 2>/dev/null"]
    for k, v in env.items():
        parts.append(f"export {k}={q(v)}")
    for k, content in files.items():
        parts.append(f'f=$(mktemp) && printf %s {q(content)} >"$f" && export {k}="$f"')
    parts.append("exec " + " ".join(q(a) for a in cmd))
    return "; ".join(parts)


SSH_CONNECT_TIMEOUT_S = 10
# Never prompt (a rank cannot answer), give up on a silent host.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}")


def _preflight_hosts(hosts: Sequence[Host], timeout: float = SSH_CONNECT_TIMEOUT_S + 5) -> None:
    """Reach every remote host over ssh once (in parallel) before starting
    anything, so a host that does not resolve or answer is one clear error
    instead of a rank (or an mpirun daemon) failing mid-start."""
    names = list(dict.fromkeys(h.name for h in hosts))
    failures: dict[str, str] = {}

    def probe(name: str) -> None:
        cmd = ["ssh", *SSH_OPTIONS, name, "true"]
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, timeout=timeout)
        except FileNotFoundError:
            failures[name] = "no ssh client on this machine"
            return
        except subprocess.TimeoutExpired:
            failures[name] = f"no answer within {timeout:g} s"
            return
        if p.returncode != 0:
            lines = [x for x in p.stderr.decode(errors="replace").splitlines() if x.strip()]
            failures[name] = lines[-1].strip() if lines else f"ssh exited with code {p.returncode}"

    threads = [threading.Thread(target=probe, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        name = next(n for n in names if n in failures)
        more = f" (and {len(failures) - 1} more host(s))" if len(failures) > 1 else ""
        raise UserError(f"cannot reach host {name} over ssh: {failures[name]}{more}")


def ssh_command(host: Host, env: Mapping[str, str], files: Mapping[str, str],
                cmd: Sequence[str], cwd: str) -> list[str]:
    """argv that starts one rank on ``host`` over ssh. ``-tt`` gives the
    remote command a terminal so that ending the local ssh hangs it up."""
    return [
        "ssh", "-tt", *SSH_OPTIONS,
        "-o", "LogLevel=QUIET",
        host.name,
        _remote_script(env, files, cmd, cwd),
    ]
