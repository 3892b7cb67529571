import json

import pytest

from mlxcel_dist.errors import UserError
from mlxcel_dist.cluster.hostfile import (
    Host,
    assign_ranks,
    is_local_host,
    parse_hostfile,
    parse_hostfile_text,
    read_hostfile,
    total_slots,
)


def write(tmp_path, text, name="hosts"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# --------------------------------------------------------------------------- #
# OpenMPI text
# --------------------------------------------------------------------------- #


def test_text_hostfile_full(tmp_path):
    path = write(
        tmp_path,
        "# two macs\n"
        "\n"
        "mac1 slots=2   # head node\n"
        "   mac2\n"
        "10.0.0.3 slots = 4 max_slots=8\n"
        "user@mac4 max-slots=2\n",
    )
    hosts = parse_hostfile(path)
    assert [(h.name, h.slots) for h in hosts] == [
        ("mac1", 2), ("mac2", 1), ("10.0.0.3", 4), ("user@mac4", 1)
    ]
    assert all(h.ips == [] for h in hosts)
    assert total_slots(hosts) == 8
    info = read_hostfile(path)
    assert info.format == "mpi" and info.backend == "" and info.envs == {}


def test_text_duplicate_hosts_add_up():
    hosts = parse_hostfile_text("a slots=2\nb\na slots=1\n")
    assert [(h.name, h.slots) for h in hosts] == [("a", 3), ("b", 1)]


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("a slots=2\nb slots=0\n", 2, "slots"),
        ("a slots=two\n", 1, "positive integer"),
        ("# c\n\na cores=2\n", 3, "unknown option"),
        ("a slots\n", 1, "key=value"),
        ("a slots=2 max_slots=1\n", 1, "max_slots"),
        ("a slots=1 slots=2\n", 1, "twice"),
        ("slots=2\n", 1, "host name"),
        ("bad/host slots=1\n", 1, "bad host name"),
        ("a slots=-1\n", 1, "positive integer"),
    ],
)
def test_text_errors_name_file_and_line(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as e:
        parse_hostfile(path)
    msg = str(e.value)
    assert path in msg
    assert f"line {line}" in msg
    assert words in msg
    assert "\n" not in msg


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   # another\n"])
def test_text_without_hosts(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(UserError, match="no hosts"):
        parse_hostfile(path)


def test_missing_and_unreadable(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        parse_hostfile(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="is a directory"):
        parse_hostfile(str(tmp_path))
    p = tmp_path / "bin"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="UTF-8"):
        parse_hostfile(str(p))


# --------------------------------------------------------------------------- #
# MLX JSON
# --------------------------------------------------------------------------- #


def test_json_list(tmp_path):
    data = [
        {"ssh": "mac1", "ips": ["192.168.10.1"]},
        {"ssh": "mac2", "ips": ["192.168.10.2", "fe80::1"]},
    ]
    path = write(tmp_path, json.dumps(data, indent=2), "hosts.json")
    info = read_hostfile(path)
    assert info.format == "json"
    assert info.hosts == [
        Host("mac1", 1, ["192.168.10.1"]),
        Host("mac2", 1, ["192.168.10.2", "fe80::1"]),
    ]
    assert info.hosts[0].address == "192.168.10.1"


def test_json_object_with_backend_envs_rdma_slots(tmp_path):
    data = {
        "backend": "jaccl",
        "envs": ["MLX_METAL_FAST_SYNCH=1", "A=b=c"],
        "hosts": [
            {"ssh": "m1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]},
            {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None], "slots": 2},
        ],
    }
    info = read_hostfile(write(tmp_path, json.dumps(data)))
    assert info.backend == "jaccl"
    assert info.envs == {"MLX_METAL_FAST_SYNCH": "1", "A": "b=c"}
    assert info.hosts[0].rdma == [None, "rdma_en3"]
    assert [h.slots for h in info.hosts] == [1, 2]


def test_json_host_without_ips_uses_name():
    h = Host("user@mac1")
    assert h.address == "mac1"


@pytest.mark.parametrize(
    "text, line, words",
    [
        ('[\n  {"ssh": "a"},\n  {"ssh": "b",}\n]', 3, "invalid JSON"),
        ('[\n  {"ssh": "a"},\n  {"ips": ["1.2.3.4"]}\n]', 3, '"ssh"'),
        ('[\n  {"ssh": "a", "ips": "1.2.3.4"}\n]', 2, "list of strings"),
        ('[\n  {"ssh": "a"},\n\n  {"ssh": "b", "ips": ["1.2.3"]}\n]', 4, "not an IP"),
        ('[\n  {"ssh": "a", "slots": 0}\n]', 2, "slots"),
        ('[\n  "a"\n]', 2, "not an object"),
        ('{"hosts": [\n {"ssh": "a"},\n {"ssh": "b c"}\n]}', 3, "bad host name"),
    ],
)
def test_json_errors_name_file_and_line(tmp_path, text, line, words):
    path = write(tmp_path, text, "h.json")
    with pytest.raises(UserError) as e:
        parse_hostfile(path)
    msg = str(e.value)
    assert path in msg and f"line {line}" in msg and words in msg, msg


@pytest.mark.parametrize(
    "text, words",
    [
        ("[]", "no hosts"),
        ('{"backend": "ring"}', '"hosts"'),
        ('{"hosts": {"ssh": "a"}}', "JSON list"),
        ('{"hosts": [{"ssh": "a"}], "envs": ["nope"]}', "envs"),
        ('{"hosts": [{"ssh": "a"}], "backend": 3}', "backend"),
    ],
)
def test_json_structure_errors(tmp_path, text, words):
    path = write(tmp_path, text, "h.json")
    with pytest.raises(UserError) as e:
        parse_hostfile(path)
    assert path in str(e.value) and words in str(e.value)


# --------------------------------------------------------------------------- #
# placement / locality
# --------------------------------------------------------------------------- #


def test_assign_ranks_fills_slots_in_order():
    hosts = [Host("a", 2), Host("b", 1), Host("c", 3)]
    assert [h.name for h in assign_ranks(hosts, 4)] == ["a", "a", "b", "c"]
    assert [h.name for h in assign_ranks(hosts, 6)] == ["a", "a", "b", "c", "c", "c"]


def test_is_local_host():
    import socket

    assert is_local_host("localhost")
    assert is_local_host("127.0.0.1")
    assert is_local_host("user@127.0.0.1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("192.0.2.77")  # TEST-NET-1, never ours
    assert not is_local_host("surely-not-this-machine.invalid")


def test_host_ip():
    from mlxcel_dist.cluster.hostfile import host_ip

    assert host_ip(Host("mac1", 1, ["10.0.0.7", "10.1.0.7"])) == "10.0.0.7"  # its first ip
    assert host_ip(Host("user@127.0.0.1")) == "127.0.0.1"
    assert host_ip(Host("localhost")) == "127.0.0.1"  # IPv4 first: MLX's ring parses numeric ones
    # unresolvable here: the name itself, for the ssh probe to report
    assert host_ip(Host("surely-not-this-machine.invalid")) == "surely-not-this-machine.invalid"


def test_per_host_weights(tmp_path):
    from fractions import Fraction

    from mlxcel_dist.cluster.hostfile import rank_weights

    hosts = parse_hostfile(write(tmp_path, "big slots=1 weight=3\nsmall slots=2\n"))
    assert rank_weights(hosts, 3) == (Fraction(3), Fraction(1), Fraction(1))
    assert rank_weights(parse_hostfile(write(tmp_path, "a slots=2\nb\n")), 3) is None
    js = write(tmp_path, json.dumps([{"ssh": "a", "weight": 1.5}, {"ssh": "b"}]), "h.json")
    assert rank_weights(read_hostfile(js).hosts, 2) == (Fraction(3, 2), Fraction(1))
    for bad in ("a weight=0\n", "a weight=x\n", "a weight=1\na weight=2\n"):
        with pytest.raises(UserError, match="weight"):
            parse_hostfile(write(tmp_path, bad))
    with pytest.raises(UserError, match="weight must be a positive number"):
        read_hostfile(write(tmp_path, json.dumps([{"ssh": "a", "weight": -1}]), "bad.json"))


def test_memory_per_host(tmp_path):
    from fractions import Fraction

    from mlxcel_dist.cluster.hostfile import rank_weights

    p = tmp_path / "h.txt"
    p.write_text("a slots=2 memory=128GB\nb memory=500M\n")
    hosts = parse_hostfile(p)
    assert [h.memory for h in hosts] == [128 * 10**9, 500 * 10**6]
    assert rank_weights(hosts, 3) == (Fraction(128), Fraction(128), Fraction(1))  # 64 GB, 64 GB, 0.5 GB a rank
    p.write_text("a weight=2 memory=128GB\nb memory=64GB\n")
    assert rank_weights(parse_hostfile(p), 2) == (Fraction(2), Fraction(1))  # weight= wins over memory
    p.write_text("a memory=128GB\nb\n")
    assert rank_weights(parse_hostfile(p), 2) is None  # not every host says: even shares
    j = tmp_path / "h.json"
    j.write_text('[{"ssh": "a", "memory": "2GB"}, {"ssh": "b", "memory": 1000000000}]')
    assert [h.memory for h in parse_hostfile(j)] == [2 * 10**9, 10**9]
    for bad in ("a memory=lots\n", "a memory=0\n"):
        p.write_text(bad)
        with pytest.raises(UserError, match="line 1: memory must be"):
            parse_hostfile(p)
