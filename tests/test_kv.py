"""Bounded and quantized KV caches (--max-kv-size, --kv-bits / --kv-group-size)
and --extra-eos-token.

--max-kv-size N against transformers with the same window on those layers
(tests/fixtures/max_kv, scripts/fixtures_max_kv.py) in every feeding mode,
compiled and eager; the batch engine and the prompt cache against lone
generation with the same bound; quantized attention against float attention
on the dequantized cache (the same numbers the kernel was given); quantized
batch rows (prefilled together, forked, kept and reused) as alone; np 2 under
the real launcher for both options; bad values are one `error:` line."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlxcel_dist.nn.attention import causal_attention
from mlxcel_dist.engine.batch import BatchEngine
from mlxcel_dist.engine.prefill import Together
from mlxcel_dist.cache import (KVCache, KVOptions, QuantizedKV, QuantizedKVCache, RotatingKVCache,
                               SharedKVCache, kv_caches)
from mlxcel_dist.cli import app
from mlxcel_dist.errors import UserError
from mlxcel_dist.engine.generation import Generation, sequence_logits
from mlxcel_dist.harness import FP32_REL_TOL, compare, modes
from mlxcel_dist.checkpoint.loader import default_model_dir, load_model
from mlxcel_dist.engine.prompt_cache import PromptCache
from mlxcel_dist.engine.sampling import SamplingParams
from mlxcel_dist.checkpoint.tokenizer import Tokenizer
from testproc import run_cmd

FIXTURES = Path(__file__).parent / "fixtures"
BOUNDED = sorted((FIXTURES / "max_kv").glob("*.npz"))
runner = CliRunner()


def _bounded(path):
    with np.load(path) as z:
        return z["ids"], z["logits"], int(z["max_kv_size"].item()), FIXTURES / str(z["fixture"].item())


@pytest.mark.parametrize("path", BOUNDED, ids=lambda p: p.stem)
def test_max_kv_size_matches_transformers_with_the_same_window(path):
    ids, ref, N, d = _bounded(path)
    model = load_model(d, kv=KVOptions(max_size=N)).model
    for mode, kw in modes(N, len(ids)).items():  # chunks and decode steps across N, rings wrapping
        for compiled in (True, False):
            r = compare(sequence_logits(model, ids, compiled=compiled, **kw), ref, FP32_REL_TOL)
            assert r["ok"], (mode, compiled, r)
    unbounded = sequence_logits(load_model(d).model, ids)
    assert not compare(unbounded, ref, FP32_REL_TOL)["ok"]  # the bound is what the reference measures


def test_kv_caches_bound_full_layers_and_repoint_shared_ones():
    src = KVCache()
    caches = kv_caches([src, RotatingKVCache(4), RotatingKVCache(64), SharedKVCache(src, 0)], max_size=16)
    assert [type(c) for c in caches] == [RotatingKVCache] * 3 + [SharedKVCache]
    assert [c.window for c in caches[:3]] == [16, 4, 16] and caches[3].source is caches[0]
    q = kv_caches([KVCache(), RotatingKVCache(8)], bits=4, group_size=32)
    assert isinstance(q[0], QuantizedKVCache) and type(q[1]) is RotatingKVCache  # sliding layers stay float


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (8, 32)])
def test_quantized_attention_is_float_attention_on_the_dequantized_cache(bits, group):
    rng = np.random.default_rng(bits + group)
    B, H, Hkv, D = 1, 4, 2, 64
    cache = QuantizedKVCache(bits, group)
    for L in (5, 1, 3, 1):  # a prefill, steps, a chunk (the buffer's growth too)
        q = mx.array(rng.normal(size=(B, H, L, D)).astype(np.float32))
        k, v = (mx.array(rng.normal(size=(B, Hkv, L, D)).astype(np.float32)) for _ in range(2))
        qk, qv = cache.update_and_fetch(k, v)
        assert isinstance(qk, QuantizedKV) and qk.shape == (B, Hkv, cache.offset, D)
        fk, fv = qk.dequantize(), qv.dequantize()
        for kw in ({}, {"softcap": 20.0}, {"sinks": mx.array(rng.normal(size=H).astype(np.float32))}):
            mask = "causal" if L > 1 else None
            got = causal_attention(q, qk, qv, 0.125, mask=mask, **kw)
            want = causal_attention(q, fk, fv, 0.125, mask=mask, **kw)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)
    # and the cache held is the quantization of what was fed (error within half a step of the scale)
    err = float(mx.abs(fk[..., -1:, :] - k[..., -1:, :]).max())
    assert 0 < err < (0.2 if bits == 4 else 0.02)


def test_quantized_cache_logits_stay_near_full_precision_in_every_mode():
    d = default_model_dir()  # the trained embedded model (head_dim 32)
    ids = np.array(Tokenizer(d).encode("The sea is calm today. The sky is clear and the sun is warm. There is "
                                       "a light wind from the west. It is a good day to go out in a boat."))
    full = sequence_logits(load_model(d).model, ids)
    for bits, bound in ((8, 0.02), (4, 0.2)):  # measured: benchmarks/kv_quality.py, docs/benchmarks.md
        model = load_model(d, kv=KVOptions(bits=bits, group_size=32)).model
        got = {mode: sequence_logits(model, ids, **kw) for mode, kw in modes(32, len(ids)).items()}
        for mode, x in got.items():  # every mode computes the same quantized cache
            np.testing.assert_allclose(x, got["one-pass"], atol=1e-4 * np.abs(full).max())
        r = compare(got["one-pass"], full, FP32_REL_TOL)
        assert not r["ok"] and r["rel"] < bound, (bits, r)


@pytest.mark.parametrize("path", BOUNDED[:1], ids=lambda p: p.stem)
def test_batch_engine_and_prompt_cache_with_a_bound_decode_as_alone(path):
    *_, N, d = _bounded(path)
    model = load_model(d, kv=KVOptions(max_size=N)).model
    V = model.args.vocab_size
    rng = np.random.default_rng(2)
    kept = rng.integers(3, V, 3 * N)
    prompts = [rng.integers(3, V, k) for k in (2 * N + 3, 1, 5)] + [np.concatenate([kept, rng.integers(3, V, 4)])]
    params = [SamplingParams(), SamplingParams(temp=0.9, top_k=20, seed=7), SamplingParams(), SamplingParams()]
    n = 2 * N
    alone = [list(Generation(model, p, n, s, eos_ids=(), prefill_step=N // 2 + 1)) for p, s in zip(prompts, params)]
    pc = PromptCache()
    eng = BatchEngine(model, prefill_step=N // 2 + 1, prompt_cache=pc)
    eng.add("kept", kept)
    eng.remove("kept")
    eng.add_many([(i, p, s) for i, (p, s) in enumerate(zip(prompts, params))])
    got = {i: [] for i in range(len(prompts))}
    for _ in range(n):
        for rid, tok in eng.step().items():
            got[rid].append(tok)
    assert eng.static and pc.hits == 1
    assert [got[i] for i in range(len(prompts))] == alone


def test_quantized_cache_rows_batch_prefill_fork_and_reuse_as_alone(monkeypatch):
    # --kv-bits rows in the batch buffers (cache.QuantizedRowCache): prompts
    # prefilled together (QuantizedPrefillCache, one a prompt-cache hit), a
    # copy of a prompt (n > 1: forked), rows leaving with a step in flight and
    # a later prompt reusing the quantized entry: each request's ids alone
    import mlxcel_dist.engine.batch as batch
    import mlxcel_dist.engine.decode as decode

    monkeypatch.setattr(decode, "STEP", 8)  # the buffers regrow
    monkeypatch.setattr(batch, "CPU_STEP", 8)
    model = load_model(default_model_dir(), kv=KVOptions(bits=8, group_size=32)).model
    kept = np.arange(40, 58)
    prompts = [np.arange(3, 3 + k) for k in (9, 1, 20)] + [np.concatenate([kept, [7, 8, 9]]), np.arange(3, 12)]
    params = [SamplingParams()] * 4 + [SamplingParams(temp=0.9, seed=4)]
    alone = [list(Generation(model, p, 12, s, eos_ids=())) for p, s in zip(prompts, params)]
    together = []
    monkeypatch.setattr(Together, "__init__",
                        lambda self, engine, admits, L, f=Together.__init__: together.append(len(admits))
                        or f(self, engine, admits, L))
    pc = PromptCache()
    eng = BatchEngine(model, prompt_cache=pc, prefill_step=8)
    eng.add("kept", kept)
    eng.remove("kept")
    eng.add_many([(i, p, s) for i, (p, s) in enumerate(zip(prompts, params))])
    got = {i: [] for i in range(len(prompts))}
    for _ in range(12):
        for rid, tok in eng.step().items():
            got[rid].append(tok)
    assert eng.static and together == [3] and pc.hits == 1  # prompts 0, 2 and 3 (a hit) together
    assert eng.prefilled == 17 + 8 + 19 + 3  # prompt 4 forked from prompt 0
    assert [got[i] for i in range(len(prompts))] == alone
    for i in range(len(prompts)):
        eng.remove(i)
    more = np.concatenate([prompts[2], got[2][:11], [5, 6]])
    eng.add("more", more)
    assert pc.hits == 2 and [eng.step()["more"] for _ in range(6)] == list(Generation(model, more, 6))


def test_extra_eos_token_stops_generation():
    tok = Tokenizer(default_model_dir(), extra_eos=[".", "284"])
    assert {17, 284} <= set(tok.eos_ids)  # "." by its text, " The" by its id
    r = runner.invoke(app, ["generate", "-n", "40", "--extra-eos-token", "."])
    assert r.exit_code == 0, r.output
    assert r.stdout == " is calm today\n", r.stdout  # the greedy text stops before its first "."


@pytest.mark.parametrize("args,message", [
    (["--kv-bits", "7"], "--kv-bits must be one of 2, 3, 4, 5, 6, 8"),
    (["--kv-bits", "4", "--kv-group-size", "64"],
     "--kv-group-size 64 does not divide the model's head_dim 32: use --kv-group-size 32"),  # asked for: kept
    (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be one of 32, 64, 128"),
    (["--kv-bits", "4", "--max-kv-size", "64"], "give one of them"),
    (["--max-kv-size", "0"], "--max-kv-size must be >= 1"),
    (["--extra-eos-token", "nosuchtoken"], "--extra-eos-token 'nosuchtoken' is not a token"),
    (["--np", "2", "--kv-bits", "3", "--kv-group-size", "128"], "does not divide"),  # before launching
])
def test_bad_kv_and_eos_options_are_one_line(args, message):
    for cmd in (["generate"], ["bench"]) if "--extra-eos-token" not in args else (["generate"], ["serve"]):
        r = runner.invoke(app, [*cmd, *args])
        assert r.exit_code == 2, (cmd, r.output)
        assert r.stderr.startswith("error: ") and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_kv_group_size_when_not_given_is_the_largest_dividing_head_dim():
    # the default model's head_dim is 32: 128 and 64 do not divide it, so --kv-bits alone quantizes in 32s
    kv = KVOptions(bits=8).check(head_dim=32)
    assert kv.group_size == 32 and "groups of 32 (the largest" in kv.describe()
    assert KVOptions(bits=4).check(head_dim=256).group_size == 128
    assert KVOptions(bits=4).check(head_dim=192).group_size == 64
    assert KVOptions(bits=4, group_size=32).check(head_dim=256).group_size == 32  # a given size is kept
    with pytest.raises(UserError, match="head_dim 48 is not a multiple of 32"):
        KVOptions(bits=4).check(head_dim=48)
    unchecked = KVOptions(bits=8)  # a library caller that never calls check: applied, it fits the model
    load_model(default_model_dir(), kv=unchecked)
    assert unchecked.group_size == 32
    r = runner.invoke(app, ["generate", "-n", "6", "--kv-bits", "8", "--verbose"])
    assert r.exit_code == 0, r.output
    assert "kv cache: 8-bit, groups of 32 (the largest of 128/64/32 dividing head_dim" in r.stderr
    quantized = runner.invoke(app, ["generate", "-n", "6", "--kv-bits", "8", "--kv-group-size", "32"])
    assert quantized.exit_code == 0 and r.stdout == quantized.stdout  # the same cache as asking for 32


# Real launcher: 2 ranks -------------------------------------------------------------------------
def _cli():
    import sys

    exe = Path(sys.executable).parent / "mlxcel-dist"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mlxcel_dist.cli"]


@pytest.mark.parametrize("split", [["--np", "2"], ["--pp", "2"]], ids=["np2", "pp2"])
def test_np2_and_pp2_max_kv_size_match_transformers_in_every_mode(tmp_path, split):
    # logit-match: every mode (compiled decode on rings of N slots) at np 1 and split, against the reference
    *_, N, d = _bounded(FIXTURES / "max_kv" / "gemma3__gqa_fp32.npz")
    p = run_cmd(_cli() + ["logit-match", str(d), "--max-kv-size", str(N), "--reference",
                          str(FIXTURES / "max_kv" / "gemma3__gqa_fp32.npz"), *split, "--backend", "mpi"],
                timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "15/15 comparisons match" in p.stdout, p.stdout


@pytest.mark.parametrize("split", [["--np", "2"], ["--pp", "2"]], ids=["np2", "pp2"])
def test_np2_and_pp2_quantized_cache_logits_match_np1(tmp_path, split):
    # each rank quantizes its own KV heads (np 2) or layers (pp 2) alike: every mode as at np 1
    p = run_cmd(_cli() + ["logit-match", "--kv-bits", "4", "--kv-group-size", "32", *split, "--backend", "mpi"],
                timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "5/5 comparisons match" in p.stdout, p.stdout


def test_np2_generate_with_both_options_agrees_with_np1(tmp_path):
    for args in (["--max-kv-size", "12"], ["--kv-bits", "8", "--kv-group-size", "32"]):
        argv = ["generate", "-n", "30", "--extra-eos-token", "355", *args]  # 355: " wind"
        one = runner.invoke(app, argv)
        two = run_cmd(_cli() + argv + ["--np", "2", "--backend", "mpi"], timeout=300, cwd=tmp_path)
        assert one.exit_code == 0 and two.returncode == 0, one.output + two.stderr
        assert two.stdout == one.stdout and one.stdout.strip(), (one.stdout, two.stdout)


def test_compiled_decode_on_quantized_static_buffers(monkeypatch):
    import mlxcel_dist.engine.decode as decode

    monkeypatch.setattr(decode, "STEP", 8)  # buffers regrow several times over the run
    model = load_model(default_model_dir(), kv=KVOptions(bits=4, group_size=32)).model
    ids = np.random.default_rng(0).integers(3, 512, 60)
    one = sequence_logits(model, ids)  # the eager QuantizedKVCache over the whole sequence
    compiled = sequence_logits(model, ids, decode_from=5)
    assert "quantized" in model.engine.kinds and 1 <= model.engine.traces < 10
    eager = sequence_logits(model, ids, decode_from=5, compiled=False)
    np.testing.assert_array_equal(compiled, eager)
    assert compare(compiled, one, FP32_REL_TOL)["rel"] < 1e-5
