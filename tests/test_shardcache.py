"""The shard cache (issue 43): a host without MODEL gets only its ranks'
pieces over TCP and loads them as from the checkpoint.

One machine, no sshd: the launcher's side (fetch.fetch_shards) serves on
loopback and starts the receiver as a local process for a "host" whose
cache is its own directory and whose MODEL path (what the ranks are told)
does not exist. Real ranks then load from that cache (launcher.launch with
the environment fetch returned) and must give the same bits as a load from
the checkpoint. tests/test_multihost.py does the same over real sshd.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.checkpoint import fetch
from mlxcel_dist.checkpoint import shardcache as sc
from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.errors import UserError
from mlxcel_dist.cluster.hostfile import Host
from mlxcel_dist.checkpoint.loader import build_rank, default_model_dir, open_model, planned_reads

from testproc import run_cmd

FIX = Path(__file__).parent / "fixtures"
GEMMA = FIX / "gemma3" / "gqa_fp32"
LLAMA_Q4 = FIX / "mlx_lm" / "llama_q4"
QWEN_MOE_Q4 = FIX / "mlx_lm" / "qwen3_moe_q4"
MISSING = "/nonexistent/mlxcel-dist/model"  # MODEL as the receiving host's ranks are told it
CLI = [sys.executable, "-m", "mlxcel_dist.cli"]


def _fetch(src: Path, cache: Path, np_: int = 2, pp: int = 1, weights=None, split=None, model_arg: str = MISSING,
           ranks=None, adapter=None, dry: bool = False):
    """Fetch ranks `ranks` (default: all) of an np_-rank job to one local "host" with cache `cache`."""
    ck = open_model(src)
    ranks = list(range(np_)) if ranks is None else ranks
    pieces = {r: sc.rank_pieces(ck, np_, r, pp, weights, split) for r in ranks}
    spec, states = fetch.fetch_shards(ck, model_arg, {"hostb": (Host("localhost"), ranks)}, pieces, str(cache),
                                      adapter, dry=dry)
    return (json.loads(spec) if spec else None), states["hostb"], pieces


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint8) if a.dtype == mx.bfloat16 else a)


def _assert_entry_reads_like_source(src: Path, spec: dict, cache: Path, np_: int, pp: int = 1, weights=None,
                                    split=None):
    """Each rank's load on paper against its entry reads the very bytes it reads from the checkpoint."""
    ck = open_model(src)
    for r in range(np_):
        entry = open_model(cache / spec["key"] / spec["ranks"][str(r)])
        g = Group.planned(np_, r, weights, split)
        m1, refs1, f1 = build_rank(ck, g, pp, ck.dtype)
        m2, refs2, f2 = build_rank(entry, Group.planned(np_, r, weights, split), pp, ck.dtype)
        a, b = list(planned_reads(m1, refs1, f1)), list(planned_reads(m2, refs2, f2))
        assert [x[0] for x in a] == [x[0] for x in b]
        for (name, r1, ax, rg), (_, r2, ax2, rg2) in zip(a, b):
            x, y = r1.read(ax, rg), r2.read(ax2, rg2)
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(_bits(x), _bits(y)), (r, name)


@pytest.mark.parametrize("src,np_,pp,weights,split", [
    (GEMMA, 2, 1, None, None),
    (GEMMA, 3, 1, (2, 1, 1), None),  # uneven TP
    (GEMMA, 2, 2, None, None),  # pp 2
    (GEMMA, 4, 2, None, None),  # pp 2 x tp 2
    (LLAMA_Q4, 2, 1, None, None),  # MLX-quantized: packed columns, scales, biases at group boundaries
    (QWEN_MOE_Q4, 2, 1, None, "experts"),  # whole experts per rank
], ids=["np2", "np3-uneven", "pp2", "pp2xtp2", "q4-np2", "moe-experts"])
def test_entries_hold_what_each_rank_reads(tmp_path, src, np_, pp, weights, split):
    from fractions import Fraction

    weights = tuple(Fraction(w) for w in weights) if weights else None
    spec, st, pieces = _fetch(src, tmp_path / "cache", np_, pp, weights, split)
    shard = sum(p.nbytes for p in {p.key: p for ps in pieces.values() for p in ps}.values())
    files = sum((src / n).stat().st_size for n in sc.small_files(src))
    assert st.sent == shard + files  # pieces once each (ranks of a host share them), plus config/tokenizer
    _assert_entry_reads_like_source(src, spec, tmp_path / "cache", np_, pp, weights, split)
    if np_ == 2 and pp == 1 and split is None:
        # a rank reads less than the checkpoint: its shard, not a copy of the whole
        one = sum(p.nbytes for p in pieces[1])
        assert one < 0.7 * sum(open_model(src).tensor_bytes().values())


def test_second_fetch_moves_nothing_and_another_split_copies_on_the_host(tmp_path):
    cache = tmp_path / "cache"
    spec, st, _ = _fetch(GEMMA, cache)
    assert st.sent > 0
    spec2, st2, _ = _fetch(GEMMA, cache)
    assert st2.sent == 0 and spec2 == spec
    # np 4's pieces lie inside np 2's: copied from those entries, nothing sent
    spec4, st4, pieces4 = _fetch(GEMMA, cache, 4)
    assert st4.sent == 0 and st4.result["local_bytes"] > 0
    _assert_entry_reads_like_source(GEMMA, spec4, cache, 4)
    # pp 2 needs whole tensors np 2 holds in halves: those come over the link, the rest is copied
    _, stp, _ = _fetch(GEMMA, cache, 2, 2)
    assert 0 < stp.sent < st.sent


def test_corrupted_piece_is_refetched_alone(tmp_path):
    cache = tmp_path / "cache"
    spec, _, pieces = _fetch(GEMMA, cache)
    entry = cache / spec["key"] / spec["ranks"]["1"]
    manifest = json.loads((entry / sc.MANIFEST).read_text())
    ps = [sc.Piece.from_json(j) for j in manifest["pieces"]]
    _, offs = sc.safetensors_header(ps)
    # rank 1's largest own piece (no other entry holds it), one byte flipped in its middle
    i = max((k for k in range(len(ps)) if ps[k].axis is not None), key=lambda k: ps[k].nbytes)
    with open(entry / sc.WEIGHTS, "r+b") as f:
        f.seek(offs[i] + ps[i].nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    spec2, st, _ = _fetch(GEMMA, cache)
    assert spec2 == spec and st.sent == ps[i].nbytes  # that piece only
    _assert_entry_reads_like_source(GEMMA, spec, cache, 2)


def test_what_a_crash_loses_after_the_manifest_is_fetched_again(tmp_path):
    """Entries are not fsynced (fetch_receiver: `_Rank.finish`): a host that
    crashes after an entry's manifest was written may come back with its
    weights file cut short or its small files empty. The next launch's hash
    check finds that, and the entry is made whole again (header included),
    never read as it was."""
    cache = tmp_path / "cache"
    spec, st, _ = _fetch(GEMMA, cache)
    for r in ("0", "1"):
        entry = cache / spec["key"] / spec["ranks"][r]
        os.truncate(entry / sc.WEIGHTS, 0)  # every page of it lost
        (entry / "config.json").unlink()
        (entry / "config.json").write_bytes(b"")
    spec2, st2, _ = _fetch(GEMMA, cache)
    small = sum((GEMMA / n).stat().st_size for n in sc.small_files(GEMMA))  # the host's _files/ copies are whole
    assert spec2 == spec and st2.sent == st.sent - small  # every piece again
    _assert_entry_reads_like_source(GEMMA, spec, cache, 2)


def test_the_receiver_imports_neither_numpy_nor_mlx():
    """Its start is on a first launch's path (issue 43): numpy's import was
    most of it. It needs neither unless it copies a piece from another entry."""
    code = ("import sys, mlxcel_dist.checkpoint.fetch_receiver; "
            "print(sorted(m for m in ('numpy', 'mlx.core', 'dataclasses') if m in sys.modules))")
    out = run_cmd([sys.executable, "-c", code], timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_copy_at_another_revision_is_not_used(tmp_path):
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(GEMMA, same)
    shutil.copytree(GEMMA, other)
    w = other / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor: same header, other bytes
    w.write_bytes(bytes(data))
    spec, st, _ = _fetch(GEMMA, tmp_path / "cache", model_arg=str(same))
    assert spec is None and st.result == {"local": True} and st.sent == 0  # reads its own copy
    spec, st, _ = _fetch(GEMMA, tmp_path / "cache", model_arg=str(other))
    assert "different revision (model.safetensors differs)" in st.result["note"]
    assert st.sent > 0 and set(spec["ranks"]) == {"0", "1"}
    _assert_entry_reads_like_source(GEMMA, spec, tmp_path / "cache", 2)


def _valid_entries(cache: Path) -> list:
    return [d for d in cache.glob("*/*") if (d / sc.MANIFEST).exists()]


def test_a_cut_link_is_one_error_and_the_next_fetch_resumes(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _, dry, pieces = _fetch(GEMMA, cache, dry=True)
    total = dry.result["bytes"]
    monkeypatch.setenv("MLXCEL_DIST_INJECT_FAULT", f"fetch-cut:{total // 2}")
    with pytest.raises(UserError) as e:
        _fetch(GEMMA, cache)
    msg = str(e.value)
    assert msg.startswith("fetching the shards to host hostb failed: ") and "\n" not in msg, msg
    assert "link" in msg and "dropped" in msg
    assert _valid_entries(cache) == []  # nothing half-written counts as an entry
    assert list(cache.glob("*/*.partial"))
    monkeypatch.delenv("MLXCEL_DIST_INJECT_FAULT")
    spec, st, _ = _fetch(GEMMA, cache)
    assert 0 < st.sent < total - total // 4  # resumed: the pieces received before the cut stay
    assert len(_valid_entries(cache)) == 2 and not list(cache.glob("*/*.partial"))
    _assert_entry_reads_like_source(GEMMA, spec, cache, 2)


def test_the_launcher_hashes_each_piece_once(tmp_path, monkeypatch):
    """The launching host remembers the sha256 of each piece it served (per
    revision): a later fetch to a host with nothing cached hashes nothing
    on the launcher, and the host still checks every piece against it. A
    wrong remembered sha256 fails that launch in one line and is forgotten,
    so the next launch hashes afresh and completes."""
    cache = tmp_path / "cache"
    spec, st, pieces = _fetch(GEMMA, cache)
    key, ck = spec["key"], open_model(GEMMA)
    known = sc.piece_hashes(cache, key)
    sent = {p.key: p for ps in pieces.values() for p in ps}
    assert known == {k: fetch._digest(ck.refs[p.name], p).hex() for k, p in sent.items()}

    def no_hashing(*_):
        raise AssertionError("a remembered piece was hashed again")

    shutil.rmtree(cache / key)  # the host's entries gone: a host with nothing, the launcher's memory kept
    with monkeypatch.context() as m:
        m.setattr(fetch, "_digest", no_hashing)
        spec2, st2, _ = _fetch(GEMMA, cache)
    assert st2.sent == st.sent and st2.hashed == {} and spec2 == spec
    _assert_entry_reads_like_source(GEMMA, spec2, cache, 2)

    shutil.rmtree(cache / key)
    wrong = max(sent, key=lambda k: sent[k].nbytes)
    sc.write_atomic(cache / "pieces" / f"{key}.json", json.dumps({**known, wrong: "0" * 64}).encode())
    with pytest.raises(UserError, match=f"failed: .*{wrong}.* arrived corrupted") as e:
        _fetch(GEMMA, cache)
    assert "\n" not in str(e.value) and _valid_entries(cache) == []
    assert sc.piece_hashes(cache, key) == {}
    spec3, _, _ = _fetch(GEMMA, cache)
    assert sc.piece_hashes(cache, key) == known
    _assert_entry_reads_like_source(GEMMA, spec3, cache, 2)


def test_a_full_disk_is_one_error_naming_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCEL_DIST_INJECT_FAULT", "diskfull")
    with pytest.raises(UserError) as e:
        _fetch(GEMMA, tmp_path / "cache")
    msg = str(e.value)
    assert "host hostb: cannot write the shard cache at" in msg and "No space left on device" in msg, msg
    assert "\n" not in msg and _valid_entries(tmp_path / "cache") == []


def test_an_entry_read_for_another_split_is_one_error(tmp_path):
    spec, _, _ = _fetch(GEMMA, tmp_path / "cache")
    entry = open_model(tmp_path / "cache" / spec["key"] / spec["ranks"]["0"])
    m, refs, full = build_rank(entry, Group.planned(3, 1), 1, None)  # np 3's rank 1 wants other rows
    with pytest.raises(UserError, match="the shard cache entry holds no .* of axis"):
        for _, ref, axis, ranges in planned_reads(m, refs, full):
            ref.read(axis, ranges)


# real ranks ---------------------------------------------------------------------------------------


def _launch_logits(tmp_path, model: str, ids, name: str, extra=(), env=None) -> np.ndarray:
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / f"{name}.npy"
    argv = ["logits", model, "--tokens-file", str(tmp_path / "ids.npy"), "--out", str(out), *extra]
    code = ("import sys; from mlxcel_dist.cluster.launcher import launch; "
            f"sys.exit(launch({argv!r}, 2, 'ring', env={env or {}!r}))")
    p = run_cmd([sys.executable, "-c", code], timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    return np.load(out)


@pytest.mark.parametrize("src,pp", [(GEMMA, 1), (GEMMA, 2), (LLAMA_Q4, 1)], ids=["np2", "pp2", "q4-np2"])
def test_ranks_load_from_the_cache_with_the_same_bits(tmp_path, src, pp):
    spec, st, _ = _fetch(src, tmp_path / "cache", 2, pp)
    ids = np.arange(3, 40) % open_model(src).args.vocab_size
    extra = ["--np", "2"] + (["--pp", "2"] if pp > 1 else [])
    full = _launch_logits(tmp_path, str(src), ids, "full", extra)
    cached = _launch_logits(tmp_path, MISSING, ids, "cached", extra, {sc.ENV: json.dumps(spec)})
    assert cached.dtype == full.dtype and np.array_equal(cached, full)


def _cli(tmp_path, args, fault="nocopy"):
    env = dict(os.environ, MLXCEL_DIST_INJECT_FAULT=fault)
    return run_cmd([*CLI, *args], timeout=240, cwd=tmp_path, env=env)


def test_cli_with_a_hostfile_fetches_once_then_sends_nothing(tmp_path):
    # every host acts as if it had no copy (`nocopy`): localhost gets its ranks' shards over TCP
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    ids = np.arange(5, 30)
    np.save(tmp_path / "ids.npy", ids)
    adapter = FIX / "lora" / "lora_last2"
    base = ["logits", str(default_model_dir()), "--tokens-file", str(tmp_path / "ids.npy"), "--np", "2",
            "--adapter-path", str(adapter), "--backend", "ring"]
    fetched = base + ["--hostfile", str(tmp_path / "hosts"), "--shard-cache", str(tmp_path / "cache")]
    p = _cli(tmp_path, fetched + ["--out", str(tmp_path / "a.npy")])
    assert p.returncode == 0, p.stderr
    assert "mlxcel-dist: fetch localhost: sent " in p.stderr and "no copy of MODEL" in p.stderr
    assert list((tmp_path / "cache" / "adapters").glob("*/adapters.safetensors"))
    p = _cli(tmp_path, fetched + ["--out", str(tmp_path / "b.npy")])
    assert p.returncode == 0 and "mlxcel-dist: fetch localhost: sent 0 B (0 bytes" in p.stderr, p.stderr
    p = _cli(tmp_path, base + ["--out", str(tmp_path / "c.npy")], fault="")
    assert p.returncode == 0, p.stderr
    a, b, c = (np.load(tmp_path / f"{x}.npy") for x in "abc")
    assert np.array_equal(a, c) and np.array_equal(b, c)
    plan = _cli(tmp_path, ["plan", str(default_model_dir()), "--hostfile", str(tmp_path / "hosts"), "--ask-hosts",
                           "--shard-cache", str(tmp_path / "cache")])
    assert plan.returncode == 0 and "fetch localhost: would send 0 B" in plan.stdout, plan.stdout + plan.stderr


def test_no_fetch_keeps_the_refusal(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    np.save(tmp_path / "ids.npy", np.arange(5, 9))
    p = _cli(tmp_path, ["logits", str(GEMMA), "--tokens-file", str(tmp_path / "ids.npy"), "--out",
                        str(tmp_path / "a.npy"), "--np", "2", "--hostfile", str(tmp_path / "hosts"), "--no-fetch",
                        "--backend", "ring"], fault="nomodel:1")
    assert p.returncode != 0 and "not found on rank 1" in p.stderr and "without --no-fetch" in p.stderr, p.stderr


def test_cli_cut_link_fails_in_one_line_and_the_next_launch_resumes(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    np.save(tmp_path / "ids.npy", np.arange(5, 30))
    args = ["logits", str(GEMMA), "--tokens-file", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "a.npy"),
            "--np", "2", "--hostfile", str(tmp_path / "hosts"), "--shard-cache", str(tmp_path / "cache"),
            "--backend", "ring"]
    _, dry, _ = _fetch(GEMMA, tmp_path / "other-cache", dry=True)
    total = dry.result["bytes"]  # what a first launch sends
    p = _cli(tmp_path, args, fault=f"nocopy,fetch-cut:{total // 3}")
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: fetching the shards to host localhost failed: host localhost: the link ")
    assert p.stderr.count("\n") == 1 and "the next launch resumes" in p.stderr, p.stderr
    assert not (tmp_path / "a.npy").exists()
    p = _cli(tmp_path, args)
    assert p.returncode == 0, p.stderr
    sent = int(p.stderr.split("mlxcel-dist: fetch localhost: sent ")[1].split("(")[1].split(" bytes")[0])
    assert 0 < sent < total - total // 6, p.stderr  # the pieces written before the cut were kept


def test_progress_shows_each_hosts_bytes_rate_and_time_left():
    import io
    import time

    from rich.console import Console

    out = io.StringIO()
    st = fetch._HostState("mac-2")
    st.total = 400_000_000
    bar = fetch._Progress({"mac-2": st}, show=True,
                          console=Console(file=out, force_terminal=True, width=120, color_system=None))
    for i in range(1, 6):
        st.sent = i * 40_000_000
        time.sleep(0.25)
    bar.stop()
    text = out.getvalue()
    assert "fetch mac-2" in text and "/400.0 MB" in text and "MB/s" in text, text
    assert any(c.isdigit() for c in text.split("MB/s")[-1]), text  # a time left after the rate


def test_plan_with_a_hostfile_says_what_each_other_host_could_receive(tmp_path):
    from typer.testing import CliRunner

    from mlxcel_dist.cli import app

    (tmp_path / "hosts").write_text("localhost slots=1\nmac-2 slots=1\n")
    r = CliRunner().invoke(app, ["plan", str(GEMMA), "--hostfile", str(tmp_path / "hosts")])
    assert r.exit_code == 0, r.output
    shard = sum(p.nbytes for p in sc.rank_pieces(open_model(GEMMA), 2, 1))
    assert f"fetch mac-2: at most {shard / 1e3:.2f} kB ({shard} bytes: its ranks' shards;" in r.output, r.output
    assert "fetch localhost" not in r.output
