"""Hostfiles: which machines the ranks run on.

Two formats are accepted, detected from the first non-blank character:

* OpenMPI text hostfiles (what ``mpirun --hostfile`` reads)::

      # comment
      mac-studio-1 slots=2      # two ranks on this host
      mac-studio-2              # a host alone is one slot
      10.0.0.3 slots=1 max_slots=4

  ``slots=N`` (also ``slots = N``), ``max_slots=``/``max-slots=`` (checked,
  otherwise ignored) and ``#`` comments; blank lines are skipped. A host listed
  twice gets the sum of its slots, as OpenMPI does. ``weight=W`` (an mlxcel
  extension; the launcher writes mpirun its own hostfile) gives each of the
  host's ranks tensor-parallel weight W (see ``--rank-weights``; default 1);
  ``memory=64GB`` (also an extension) is the host's memory for its ranks:
  without weights, ranks get shares proportional to their memory (the host's
  divided by its slots), and ``plan`` refuses a placement past it.
  ``host_us_per_layer=US`` (an extension, ``plan`` only) is the host time a
  decoded token spends per layer on that host (its own measure: plan
  otherwise takes this machine's).

* MLX JSON hostfiles (what ``mlx.launch --hostfile`` reads), either a list::

      [{"ssh": "mac1", "ips": ["192.168.10.1"]},
       {"ssh": "mac2", "ips": ["192.168.10.2"]}]

  or an object ``{"backend": "ring", "envs": ["K=V"], "hosts": [...]}``. Each
  host entry is one rank (``"slots": N``, ``"weight": W``, ``"memory":
  "64GB"`` and ``"host_us_per_layer": US`` are accepted as mlxcel extensions); ``"rdma"`` (JACCL device names) is kept.

Every malformed input raises :class:`~mlxcel_dist.errors.UserError` whose
message names the file and the line.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import socket
import subprocess
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from ..errors import UserError

__all__ = [
    "Host",
    "HostfileInfo",
    "parse_hostfile",
    "read_hostfile",
    "parse_hostfile_text",
    "is_local_host",
    "total_slots",
    "assign_ranks",
    "host_ip",
    "rank_weights",
]

# Host names: DNS names, IPv4, IPv6 (with or without brackets), optional user@.
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9._-]+@)?(?:[A-Za-z0-9._-]+|\[?[0-9A-Fa-f:.%]+\]?)$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Host:
    """One machine: ``name`` is what ssh/mpirun are given, ``slots`` how many
    ranks it runs, ``ips`` the addresses peers connect to (ring/jaccl), ``rdma``
    the JACCL device matrix row (MLX JSON hostfiles only)."""

    name: str
    slots: int = 1
    ips: list[str] = field(default_factory=list)
    rdma: list | None = None
    weight: Fraction | None = None  # each of its ranks' tensor-parallel weight (None: 1)
    memory: int | None = None  # bytes of memory for its ranks together (None: not said)
    host_us_per_layer: float | None = None  # plan: a decoded token's host time per layer here (None: not said)

    @property
    def address(self) -> str:
        """The address other ranks reach this host at (first IP, else the name)."""
        if self.ips:
            return self.ips[0]
        return self.name.split("@", 1)[-1].strip("[]")

    @property
    def is_local(self) -> bool:
        """This machine (loopback, own host name, or one of its addresses)."""
        return is_local_host(self.name)


@dataclass
class HostfileInfo:
    """Everything a hostfile says: hosts plus, for MLX JSON objects, a
    preferred backend and extra ``K=V`` environment entries for the ranks."""

    path: str
    format: str  # "mpi" (OpenMPI text) or "json" (MLX)
    hosts: list[Host]
    backend: str = ""
    envs: dict[str, str] = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _local_names() -> frozenset[str]:
    # No getfqdn(): it can block for seconds on a DNS/mDNS lookup.
    names = {"localhost", "127.0.0.1", "::1", "localhost.localdomain", "ip6-localhost"}
    try:
        hn = socket.gethostname()
        short = hn.split(".")[0]
        names.update({hn, short, f"{short}.local"})
    except OSError:  # pragma: no cover - exotic hosts
        pass
    return frozenset(n.lower() for n in names if n)


def is_local_host(name: str) -> bool:
    """True for loopback addresses and this machine's own host name."""
    name = name.split("@", 1)[-1].strip("[]").lower()
    if name in _local_names():
        return True
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    # An address of one of this machine's interfaces can be bound to.
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((name, 0))
        return True
    except OSError:
        return False


def total_slots(hosts: list[Host]) -> int:
    return sum(h.slots for h in hosts)


def assign_ranks(hosts: list[Host], np: int) -> list[Host]:
    """Rank -> host, filling each host's slots in order (OpenMPI's ``--map-by
    slot``): ``a slots=2, b slots=2`` with np=3 gives ranks 0,1 on a and 2 on b."""
    out: list[Host] = []
    for h in hosts:
        for _ in range(h.slots):
            if len(out) == np:
                return out
            out.append(h)
    return out


def rank_weights(hosts: list[Host], np: int) -> tuple | None:
    """Each rank's weight from its host's ``weight`` (rank order as
    `assign_ranks`); without any, from its share of its host's ``memory``
    when every host says one; else None (even shares)."""
    ranks = assign_ranks(hosts, np)
    if any(h.weight is not None for h in hosts):
        return tuple(h.weight or Fraction(1) for h in ranks)
    if ranks and all(h.memory is not None for h in hosts):
        per = [Fraction(h.memory, h.slots) for h in ranks]
        unit = min(per)
        return tuple(p / unit for p in per)  # the smallest is 1: readable in the ranks' argv
    return None


def rank_memory(hosts: list[Host], np: int) -> list:
    """Each rank's bytes of memory (its host's divided by its slots), None where not said."""
    return [None if h.memory is None else h.memory // h.slots for h in assign_ranks(hosts, np)]


def rank_host_layer(hosts: list[Host], np: int) -> list:
    """Each rank's host seconds per layer (its host's ``host_us_per_layer``), None where not said."""
    return [None if h.host_us_per_layer is None else h.host_us_per_layer * 1e-6 for h in assign_ranks(hosts, np)]


def _host_us(path: str, line: int | None, value) -> float:
    try:
        us = float(value)
    except (TypeError, ValueError):
        us = -1.0
    if not (us >= 0 and us < float("inf")):
        raise _err(path, line, f"host_us_per_layer must be a number of microseconds >= 0, got {value!r}")
    return us


def _memory(path: str, line: int | None, value) -> int:
    from ..units import parse_size

    try:
        return parse_size(str(value), "memory")
    except UserError as e:
        raise _err(path, line, str(e)) from None


def _weight(path: str, line: int | None, value) -> Fraction:
    try:
        w = Fraction(str(value)) if not isinstance(value, bool) else None
    except (ValueError, ZeroDivisionError):
        w = None
    if w is None or w <= 0:
        raise _err(path, line, f"weight must be a positive number, not {value!r}")
    return w


@functools.lru_cache(maxsize=None)
def _ssh_hostname(name: str) -> str:
    """The address ssh would connect to for ``name`` (its HostName from
    ~/.ssh/config and friends, via ``ssh -G``), else ``name``."""
    try:
        out = subprocess.run(["ssh", "-G", name], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return name
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return name


def host_ip(h: Host) -> str:
    """An IP to listen on / connect to for a hostfile host without "ips"
    (MLX's ring parses numeric addresses only): its ssh HostName resolved,
    IPv4 first; the address itself when it does not resolve here (the ssh
    probe will name it)."""
    target = _ssh_hostname(h.address)
    try:
        infos = socket.getaddrinfo(target, None, type=socket.SOCK_STREAM)
    except OSError:
        return h.address
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return v4[0] if v4 else infos[0][4][0]


def _err(path: str, line: int | None, msg: str) -> UserError:
    where = f"hostfile {path}" + (f", line {line}" if line is not None else "")
    return UserError(f"{where}: {msg}")


def _check_host_name(path: str, line: int | None, name: str) -> None:
    if not name or not _HOST_RE.match(name):
        raise _err(path, line, f"bad host name {name!r}")


def _positive_int(path: str, line: int, key: str, value: str) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        raise _err(path, line, f"{key} must be a positive integer, not {value!r}") from None
    if n < 1:
        raise _err(path, line, f"{key} must be a positive integer, not {value!r}")
    return n


def parse_hostfile_text(text: str, path: str = "<string>") -> list[Host]:
    """Parse an OpenMPI text hostfile."""
    hosts: dict[str, Host] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        # "slots = 4" -> "slots=4"
        line = re.sub(r"\s*=\s*", "=", line)
        name, *opts = line.split()
        if "=" in name:
            raise _err(path, lineno, f"expected a host name first, got {name!r}")
        _check_host_name(path, lineno, name)
        slots: int | None = None
        max_slots: int | None = None
        weight: Fraction | None = None
        memory: int | None = None
        host_us: float | None = None
        for opt in opts:
            key, eq, value = opt.partition("=")
            key_l = key.lower()
            if not eq or not value:
                raise _err(path, lineno, f"expected key=value after the host name, got {opt!r}")
            if key_l in ("slots", "cpu", "count"):
                if slots is not None:
                    raise _err(path, lineno, "slots given twice")
                slots = _positive_int(path, lineno, key, value)
            elif key_l in ("max_slots", "max-slots"):
                max_slots = _positive_int(path, lineno, key, value)
            elif key_l == "weight":
                weight = _weight(path, lineno, value)
            elif key_l == "memory":
                memory = _memory(path, lineno, value)
            elif key_l == "host_us_per_layer":
                host_us = _host_us(path, lineno, value)
            else:
                raise _err(
                    path, lineno, f"unknown option {key!r} (expected slots=N, max_slots=N, weight=W, memory=SIZE "
                    "or host_us_per_layer=US)"
                )
        if slots is None:
            slots = 1
        if max_slots is not None and max_slots < slots:
            raise _err(path, lineno, f"max_slots={max_slots} is less than slots={slots}")
        if name in hosts:
            if weight is not None and hosts[name].weight not in (None, weight):
                raise _err(path, lineno, f"host {name!r} was given weight {hosts[name].weight} before, now {weight}")
            hosts[name].slots += slots
            hosts[name].weight = hosts[name].weight or weight
            hosts[name].memory = hosts[name].memory or memory
            hosts[name].host_us_per_layer = hosts[name].host_us_per_layer or host_us
        else:
            hosts[name] = Host(name=name, slots=slots, weight=weight, memory=memory, host_us_per_layer=host_us)
    if not hosts:
        raise UserError(f"hostfile {path}: no hosts in it")
    return list(hosts.values())


def _json_entry_lines(text: str) -> list[int]:
    """Line numbers where each element of the host list starts (best effort)."""
    m = re.search(r'"hosts"\s*:\s*\[', text)
    if m:
        pos = m.end()
    else:
        pos = text.find("[")
        if pos < 0:
            return []
        pos += 1
    dec = json.JSONDecoder()
    lines = []
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        lines.append(text.count("\n", 0, pos) + 1)
        try:
            _, pos = dec.raw_decode(text, pos)
        except ValueError:
            break
    return lines


def _parse_json(text: str, path: str) -> HostfileInfo:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _err(path, e.lineno, f"invalid JSON: {e.msg}") from None
    backend = ""
    envs: dict[str, str] = {}
    if isinstance(data, dict):
        if "hosts" not in data:
            raise _err(path, 1, 'a JSON object hostfile needs a "hosts" list')
        backend = data.get("backend", "") or ""
        if not isinstance(backend, str):
            raise _err(path, None, '"backend" must be a string')
        raw_envs = data.get("envs", []) or []
        if not isinstance(raw_envs, list):
            raise _err(path, None, '"envs" must be a list of "KEY=VALUE" strings')
        for e in raw_envs:
            if not isinstance(e, str) or not _ENV_RE.match(e):
                raise _err(path, None, f'bad "envs" entry {e!r} (expected "KEY=VALUE")')
            k, _, v = e.partition("=")
            envs[k] = v
        entries = data["hosts"]
    else:
        entries = data
    if not isinstance(entries, list):
        raise _err(path, 1, 'expected a JSON list of {"ssh": host, "ips": [...]} objects')
    lines = _json_entry_lines(text)
    hosts: list[Host] = []
    for i, h in enumerate(entries):
        line = lines[i] if i < len(lines) else None
        if not isinstance(h, dict):
            raise _err(path, line, f'host entry {i} is not an object like {{"ssh": "host"}}')
        name = h.get("ssh")
        if not isinstance(name, str):
            raise _err(path, line, f'host entry {i} has no "ssh" host name')
        _check_host_name(path, line, name)
        ips = h.get("ips", [])
        if not isinstance(ips, list) or not all(isinstance(x, str) for x in ips):
            raise _err(path, line, f'"ips" of host {name!r} must be a list of strings')
        for ip in ips:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise _err(path, line, f"{ip!r} (host {name!r}) is not an IP address") from None
        slots = h.get("slots", 1)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise _err(path, line, f'"slots" of host {name!r} must be a positive integer')
        rdma = h.get("rdma")
        if rdma is not None and not isinstance(rdma, list):
            raise _err(path, line, f'"rdma" of host {name!r} must be a list')
        weight = _weight(path, line, h["weight"]) if "weight" in h else None
        memory = _memory(path, line, h["memory"]) if "memory" in h else None
        host_us = _host_us(path, line, h["host_us_per_layer"]) if "host_us_per_layer" in h else None
        hosts.append(Host(name=name, slots=slots, ips=list(ips), rdma=rdma, weight=weight, memory=memory,
                          host_us_per_layer=host_us))
    if not hosts:
        raise UserError(f"hostfile {path}: no hosts in it")
    return HostfileInfo(path=path, format="json", hosts=hosts, backend=backend, envs=envs)


def read_hostfile(path: str | Path) -> HostfileInfo:
    """Read and validate a hostfile of either format."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"hostfile {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"hostfile {path}: is a directory") from None
    except UnicodeDecodeError:
        raise UserError(f"hostfile {path}: not a UTF-8 text file") from None
    except OSError as e:
        raise UserError(f"hostfile {path}: cannot read it ({e.strerror})") from None
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        return _parse_json(text, str(path))
    return HostfileInfo(path=str(path), format="mpi", hosts=parse_hostfile_text(text, str(path)))


def parse_hostfile(path: str | Path) -> list[Host]:
    """Hosts of an OpenMPI text or MLX JSON hostfile, in order."""
    return read_hostfile(path).hosts
