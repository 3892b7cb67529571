"""A fresh CUDA machine's first-run kernels, compiled beside the run.

MLX CUDA compiles each kernel a process first meets with NVRTC (a quantized
matmul's row tile 30-50 s, a fused elementwise kernel 3-8 s), one after
another on the evaluating thread, and keeps each on disk (MLX_PTX_CACHE_DIR,
by default <tmp>/mlx/<version>/ptx) where later processes read it when they
first need it. So a fresh machine's first token waits for every kernel of its
prefill and then every kernel of its first decode step, one by one.

`start` (called by the CLI's load, commands/launch.load_shard) runs the
decode step's kernels in a helper process while this one loads and
prefills: the same family, dtype and quantization with the first few layers
(zero weights), a one-token forward and then a few pipelined decode steps
through the engine, its kernels compiled into a cache directory of its own
and published into the shared one after each phase. Publishing is atomic per kernel (written aside, renamed in;
the `.txt` of kernel names before the `.ptx`: MLX takes a `.ptx` it finds as
complete and reads the `.txt` beside it). One helper per machine and model
(a lock file), none once a marker says it ran; `MLXCEL_DIST_WARMUP=0` turns it
off. Only where MLX runs on a CUDA GPU: nowhere else does MLX compile this way.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ..nn.experts import on_cuda

MAX_LAYERS = 8  # the helper's layers at most: enough for each layer kind's first, few for memory
MEMORY_SHARE = 0.85  # the helper runs only where the model's share and its layers take at most this of the GPU
STALE_LOCK_S = 900  # a lock older than this was left by a run that was killed


def shared_dir() -> Path:
    """Where MLX reads and writes its compiled kernels (jit_module.cpp's ptx_cache_dir)."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def helper_layers(config: dict, args) -> int:
    """Layers the helper keeps: the first of every layer kind and the first
    layer past the dense prefix (MoE models' first routed layer), at least 2."""
    text = config.get("text_config") or config
    n = int(text.get("num_hidden_layers") or 1)
    need = 2
    for types in (getattr(args, "layer_types", None), getattr(args, "mlp_layer_types", None)):
        if isinstance(types, (list, tuple)) and types:
            need = max(need, max(types.index(t) for t in set(types)) + 1)
    need = max(need, int(text.get("first_k_dense_replace") or 0) + 1)
    return min(n, need, MAX_LAYERS)


INDEX_LISTS = ("mlp_only_layers", "moe_layers", "sliding_window_layers")  # configs' lists of layer indices


def shrink(config: dict, layers: int) -> dict:
    """`config` with `layers` decoder layers (a text_config's too):
    num_hidden_layers and every per-layer list cut to that (length
    num_hidden_layers, or that plus the MTP layers a hub config lists:
    step3p5), the lists and maps of layer indices kept below it
    (`INDEX_LISTS`, step3p5's "1,2,3" `moe_layers_enum`, gemma4's
    `per_layer_config`), and no KV-sharing layers (gemma3n, gemma4: the last
    ones, read the same kernels' way as their sources)."""

    def cut(c: dict) -> dict:
        n = c.get("num_hidden_layers")
        if not isinstance(n, int) or n <= layers:
            return dict(c)
        per_layer = {n, n + int(c.get("num_nextn_predict_layers") or c.get("num_mtp_layers") or 0)}
        out = {k: (v[:layers] if isinstance(v, list) and len(v) in per_layer else v) for k, v in c.items()}
        for k in INDEX_LISTS:
            if isinstance(out.get(k), list):
                out[k] = [i for i in out[k] if isinstance(i, int) and i < layers]
        if isinstance(out.get("moe_layers_enum"), str):
            out["moe_layers_enum"] = ",".join(i for i in out["moe_layers_enum"].split(",") if int(i) < layers)
        if isinstance(out.get("per_layer_config"), dict):
            out["per_layer_config"] = {i: v for i, v in out["per_layer_config"].items() if int(i) < layers}
        if out.get("num_kv_shared_layers"):
            out["num_kv_shared_layers"] = 0
        out["num_hidden_layers"] = layers
        return out

    out = cut(config)
    if isinstance(config.get("text_config"), dict):
        out["text_config"] = cut(config["text_config"])
    return out


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


def key(config: dict, dtype) -> str:
    blob = json.dumps([config, str(dtype), mx.__version__], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def publish(private: Path, shared: Path) -> list[str]:
    """Every kernel compiled into `private` that `shared` lacks, copied in
    atomically (.txt, then .ptx); the names published."""
    done = []
    for ptx in sorted(private.rglob("*.ptx")):
        rel = ptx.relative_to(private)
        target = shared / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        for src in (ptx.with_suffix(".txt"), ptx):  # the names first: a .ptx found is read as complete
            if not src.exists():
                continue
            tmp = target.parent / f".{src.name}.{os.getpid()}.tmp"
            shutil.copyfile(src, tmp)
            os.replace(tmp, target.with_suffix(src.suffix))
        done.append(str(rel))
    return done


def build_small(model_dir: Path, dtype):
    """The checkpoint's family with `helper_layers` layers, quantized as the
    checkpoint is, every parameter zeros in the run's dtype (no weight read)."""
    from mlx.utils import tree_map

    from ..checkpoint.loader import Checkpoint, _mlx_dtype, open_model

    ck = open_model(model_dir)
    if dtype is None:  # the run keeps the stored dtype: the checkpoint's floating one
        stored = [_mlx_dtype(r.dtype) for r in ck.refs.values()]
        dtype = max((d for d in stored if mx.issubdtype(d, mx.floating)), key=stored.count, default=mx.float32)
    layers = helper_layers(ck.config, ck.args)
    small = Checkpoint(ck.dir, shrink(ck.config, layers))
    refs = None
    if small.quantization is not None:  # which layers are quantized: the checkpoint's names, first layers only
        refs = {k: v for k, v in ck.refs.items() if (_layer_index(k) or 0) < layers}
    m, _ = small.build(with_refs=refs is not None, refs=refs)

    def zeros(p):
        return mx.zeros(p.shape, dtype if mx.issubdtype(p.dtype, mx.floating) else p.dtype)

    m.update(tree_map(zeros, m.parameters()))
    m.eval()
    return m


def run_helper(model_dir: str, dtype: str, shared: Path, private: Path, marker: Path, steps: int = 3) -> list[str]:
    """The helper's work (MLX_PTX_CACHE_DIR is `private` in its process): a
    one-token forward (the decode's matmul tiles), then `steps` pipelined
    engine steps (the compiled step's fused kernels), then a server's mixed
    and several-row steps (`serve_phase`), publishing after each."""
    from ..checkpoint.loader import parse_dtype
    from .generation import Generation

    m = build_small(Path(model_dir), None if dtype == "None" else parse_dtype(dtype))
    published = []
    mx.eval(m(mx.array([[1]]), cache=m.make_cache()))
    published += publish(private, shared)
    gen = Generation(m, [1], steps)
    for _ in gen:
        pass
    gen.finish()
    published += publish(private, shared)
    if not m.own_loop:  # (a model with its own loop is served a request at a time: no server steps of ours)
        serve_phase(m)
        published += publish(private, shared)
    marker.write_text(json.dumps({"published": published}))
    return published


def serve_phase(model, prompt: int = 40) -> tuple[int, int]:
    """A server's steps, after the decode's (published first: a lone stream's
    first token waits on those): a row decoding, a prompt admitted beside it
    (on a GPU its chunk rides in the rows' forward, engine/flat.py: the mixed
    step's kernels, which a fresh server's first concurrent admission would
    otherwise compile while its streams wait), then both rows decoding (the
    several-row step). The chunk of `prompt` tokens asks for the quantized
    matmul tile a server's chunks take (64 rows). Returns (flat steps, the
    most rows a step gave)."""
    from .batch import BatchEngine
    from .prefill import default_budget
    from .sampling import SamplingParams

    eng = BatchEngine(model, budget=default_budget())  # (a budget: prompts run beside the rows, as serve's)
    eng.add_many([(0, [1], SamplingParams(), 8)])
    most = max(len(eng.step()), len(eng.step()))
    eng.add_many([(1, [1] * prompt, SamplingParams(), 3)])
    for _ in range(4):
        most = max(most, len(eng.step(prefill=prompt)))
    for rid in (0, 1):
        if rid in eng:
            eng.remove(rid)
    return eng.flat_steps, most


def fits(tensor_bytes: dict, layers: int, ranks: int, total_memory: int | None) -> bool:
    """The helper's layers fit on the GPU beside this rank's share of the
    model (`ranks` sharing it), with a margin: a first run is never put at
    risk of running out of memory for it."""
    if not total_memory:
        return True
    helper = sum(b for k, b in tensor_bytes.items() if (_layer_index(k) or 0) < layers)
    return sum(tensor_bytes.values()) / ranks + helper <= MEMORY_SHARE * total_memory


def start(model, dtype: str | None = None, ranks: int = 1) -> subprocess.Popen | None:
    """The helper for MODEL (as load_model takes it) at `dtype` (a name; None:
    the checkpoint's) on this machine, started unless not on a CUDA GPU,
    turned off, already run (marker) or running (lock), or short of memory
    beside this rank's share of `ranks`. Never the run's failure: whatever
    goes wrong here (a model the load will refuse with its own error) starts
    no helper."""
    if os.environ.get("MLXCEL_DIST_WARMUP", "1") == "0" or not on_cuda():
        return None
    try:
        return _start(model, dtype, ranks)
    except Exception:
        return None


def _start(model, dtype: str | None, ranks: int) -> subprocess.Popen | None:
    from ..checkpoint.loader import open_model, parse_dtype
    from ..cluster import faults
    from ..parallel.distributed import ENV_BACKEND, ENV_WORLD

    ck = open_model(model)
    model_dir, dtype = ck.dir, parse_dtype(dtype) or ck.dtype
    if not fits(ck.tensor_bytes(), helper_layers(ck.config, ck.args), ranks, mx.device_info().get("total_memory")):
        return None
    shared = shared_dir()
    k = key(ck.config, dtype)
    marker, lock = shared / f".mlxcel-warmup-{k}", shared / f".mlxcel-warmup-{k}.lock"
    try:
        shared.mkdir(parents=True, exist_ok=True)
        if marker.exists():
            return None
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:  # its run was killed
            lock.unlink(missing_ok=True)
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:  # running already, or no cache directory MLX could use either
        return None
    private = Path(tempfile.mkdtemp(prefix="mlxcel-warmup-"))
    code = ("import sys; from pathlib import Path; from mlxcel_dist.engine import warmup; "
            "warmup.run_helper(sys.argv[1], sys.argv[2], *map(Path, sys.argv[3:6]))")
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(private), "MLXCEL_DIST_WARMUP": "0"}
    for k_ in (ENV_WORLD, ENV_BACKEND, faults.ENV):  # a plain process, not a rank: no injected fault either
        env.pop(k_, None)
    with open(private / "helper.log", "w") as log:
        p = subprocess.Popen([sys.executable, "-c", code, str(model_dir), str(dtype).split(".")[-1], str(shared),
                              str(private), str(marker)], env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)

    def stop():  # this run is over: a helper still compiling is no use to it; the lock lets a later run retry
        if p.poll() is None:
            p.kill()
            p.wait()
        lock.unlink(missing_ok=True)
        shutil.rmtree(private, ignore_errors=True)

    atexit.register(stop)
    return p
