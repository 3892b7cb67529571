"""Issue 42's draft pair and prompt lookup on one GPU: a 7.5B llama target,
a draft made of its first 4 layers (same embedding, norm and head: the
same arrays), plain decoding against drafts (K=3, adaptive and fixed) and
prompt lookup (a text with no repeats, a text the model continues
verbatim), and mlx-lm's plain / speculative decoding on the same pair.

    python benchmarks/spec_7b.py [--gen 256] [--reps 3] [--json out.jsonl]

Random bf16 weights (std 0.02; norms 1). Two targets of one shape (hidden 4096, 32
layers, 32 q / 8 KV heads of 128, MLP 14336, vocabulary 32000, untied):
- pair: layers 4.. have their output projections (o_proj, down_proj)
  scaled by the alpha (of --alphas) whose draft agrees with the target on
  the target's own greedy ids nearest --agree (the draft pair of the
  issue accepted ~68%); drafts run on a random-id prompt.
- chain: every layer's output projections scaled by 1e-5, so the next id
  is (nearly) a function of the last one: the model continues a sequence
  it has made verbatim. Lookup texts: "miss", a random-id prompt (its
  greedy ids repeat nothing, the counts of drafts say whether they did);
  "verbatim", the model's own 200 greedy ids from one id, then their first
  24 again.

Decode tok/s is after the first id (Generation, greedy, EOS off), the
configurations interleaved per rep. Every drafted run's ids are checked
against plain decoding's (same engine: they must be equal).

The acceptance question (ours 68-69% accepted where mlx-lm "counted 80-84%"
on the same pair): both are counted here on one definition, accepted drafts /
drafted, where mlx-lm drafts K per round and a round yields its accepted
drafts + 1 (so drafted = K x (ids - accepted), the last round's short draft
aside), and both runs' greedy ids are compared with each implementation's
plain greedy ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from gpu_compare import ptx_files  # noqa: E402

SHAPE = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000, rope_theta=500000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192)
DRAFT_LAYERS = 4


def random_weights(cfg: dict, seed: int) -> list:
    from mlxcel_dist.checkpoint.loader import build_model

    shapes = tree_flatten(build_model(cfg).parameters())
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    out = []
    for i, (name, p) in enumerate(shapes):
        w = mx.ones(p.shape) if name.endswith("norm.weight") else 0.02 * mx.random.normal(p.shape, key=keys[i])
        out.append((name, w.astype(mx.bfloat16)))  # norms at 1 (llama's init): logits of a scale whose argmax
        # is not decided by rounding (random norm weights of std 0.02 make every logit ~0: ties everywhere)
        if i % 16 == 15:
            mx.eval([w for _, w in out[-16:]])
    mx.eval([w for _, w in out])
    return out


def scaled(weights: list, first_layer: int, alpha: float) -> list:
    """The output projections of layers >= first_layer times alpha (the rest: the same arrays)."""
    def layer(name):
        parts = name.split(".")
        return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1

    out = [(n, (w * alpha).astype(w.dtype) if layer(n) >= first_layer and n.endswith(("o_proj.weight",
                                                                                      "down_proj.weight")) else w)
           for n, w in weights]
    mx.eval([w for _, w in out])
    return out


def ours(cfg: dict, weights: list):
    from mlxcel_dist.checkpoint.loader import build_model

    m = build_model(cfg)
    m.load_weights(weights)
    m.eval()
    return m


def draft_of(cfg: dict, weights: list):
    """The first DRAFT_LAYERS layers, embedding, norm and head of a target: the same arrays."""
    keep = [(n, w) for n, w in weights if "layers." not in n or int(n.split("layers.")[1].split(".")[0]) < DRAFT_LAYERS]
    dcfg = dict(cfg, num_hidden_layers=DRAFT_LAYERS)
    return dcfg, keep, ours(dcfg, keep)


def traced(spec, log: list):
    """spec with its `step` (and its draft model's `draft`) timed: per call, ms, the
    kind of step (the counter it moved), (rows, drafts, accepted), the buffers' capacity,
    the draft's share and how many kernels MLX's on-disk cache gained (a compile:
    MLX_PTX_CACHE_DIR set, else -1). The drafts are evaluated apart to time them: a
    host sync a round that untraced runs do not have."""
    step, sub = spec.step, getattr(spec, "draft", None)
    box = {"draft_ms": 0.0}
    if sub is not None:
        draft = sub.draft

        def timed_draft(rows, k):
            t = time.perf_counter()
            out = draft(rows, k)
            mx.eval(out[0])
            box["draft_ms"] += (time.perf_counter() - t) * 1e3
            return out
        sub.draft = timed_draft

    def timed(engine):
        before, files, box["draft_ms"] = dict(spec.steps), ptx_files(), 0.0
        t = time.perf_counter()
        out = step(engine)
        dt = (time.perf_counter() - t) * 1e3
        moved = [k for k, v in spec.steps.items() if v != before.get(k, 0)]
        log.append({"i": len(log), "ms": round(dt, 1), "kind": ",".join(moved), "last": list(spec.last),
                    "capacity": engine.store.capacity(), "draft_ms": round(box["draft_ms"], 1),
                    "new_kernels": ptx_files() - files if files >= 0 else -1,
                    "ids": sum(len(v) for v in out.values())})
        return out
    spec.step = timed
    return spec


def generate(model, prompt, gen: int, spec=None, trace: bool = False) -> tuple[list, dict]:
    from mlxcel_dist.engine.generation import Generation

    log, trace = [], spec is not None and trace
    if trace:
        traced(spec, log)
    g = Generation(model, np.asarray(prompt, np.int32), gen, spec=spec)
    spans = []  # (start, end, new kernels, stack if still running at 0.5 s) of each engine step
    if trace:
        e_step, me = g.engine.step, threading.get_ident()

        def timed_engine(*args, **kw):  # a step still running after 0.5 s: where it is (the main thread's stack)
            t, files, where = time.perf_counter(), ptx_files(), []
            peek = threading.Timer(0.5, lambda: where.append(traceback.format_stack(sys._current_frames()[me])[-10:]))
            peek.start()
            out = e_step(*args, **kw)
            peek.cancel()
            spans.append((t, time.perf_counter(), ptx_files() - files if files >= 0 else -1, where))
            return out
        g.engine.step = timed_engine
    ids, t0, at = [], None, []
    try:
        for i in g:
            if t0 is None:
                mx.synchronize()
                t0 = time.perf_counter()
            ids.append(int(i))
            at.append(time.perf_counter())
    finally:
        if trace:  # the model's engine is kept for later runs: unwrapped
            g.engine.__dict__.pop("step", None)
    dt = time.perf_counter() - t0
    s = g.finish()
    gaps = np.diff(at) * 1e3
    info = {"decode_tok_s": (len(ids) - 1) / dt, "gen": len(ids), "longest_gap_ms": round(float(gaps.max()), 1),
            "ms_in_gaps_over_100": round(float(gaps[gaps > 100].sum()), 1)}
    if spec is not None:
        info.update(drafted=s.drafted, accepted=s.accepted, verify_rounds=s.rounds,
                    acceptance=s.accepted / s.drafted if s.drafted else 0.0, steps=dict(spec.steps))
    if spans:  # the longest gap between ids: its share in engine steps (spec.step is inside them)
        j = int(gaps.argmax()) + 1
        a, b = at[j - 1], at[j]
        inside = [(max(s, a), min(e, b), k, w) for s, e, k, w in spans if e > a and s < b]
        info["longest_gap"] = {"after_id": j, "in_engine_steps_ms": round(sum(e - s for s, e, *_ in inside) * 1e3, 1),
                               "engine_steps": len(inside), "kernels_in_them": sum(max(0, k) for _, _, k, _ in inside),
                               "stack_at_0.5_s": [ln.strip() for _, _, _, w in inside for ln in (w[0] if w else [])]}
    if log:  # the slowest steps, slowest first, and the kernels compiled over the run
        info["slowest_steps"] = sorted(log, key=lambda r: -r["ms"])[:6]
        info["steps_traced"] = len(log)
        info["new_kernels"] = sum(max(0, r["new_kernels"]) for r in log)
    return ids, info


def along(prompt, ids: list) -> mx.array:
    """The prompt and the ids but the last, int32 [P + n - 1]: a forward's logits from the prompt's last
    position on are the predictions of `ids`."""
    return mx.array(np.concatenate([prompt, np.asarray(ids[:-1], np.int32)]))


def agreement(target, draft, prompt, gen: int, ids: list | None = None) -> tuple[float, float]:
    """Share of places along the target's greedy ids (after the prompt; `ids`: along these) where draft
    and target pick the same id: by the argmax of the logits (ours), and by the argmax of log-probabilities
    rounded to the logits' dtype (mlx-lm's generate_step draws greedy ids from `logits - logsumexp(logits)`
    in bf16, where near-ties collapse and the lowest id wins)."""
    if ids is None:
        ids, _ = generate(target, prompt, gen)
    seq = along(prompt, ids)[None]
    t, d = (m(seq)[0, len(prompt) - 1:] for m in (target, draft))
    lp = [x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (t, d)]
    same = lambda a, b: float(np.mean(np.array(a.argmax(-1)) == np.array(b.argmax(-1))))  # noqa: E731
    return same(t, d), same(*lp)


def mlx_lm_model(cfg: dict, weights: list):
    from gpu_compare import build_mlx_lm

    return build_mlx_lm(cfg, weights)


def mlx_lm_run(target, draft, prompt, gen: int, k: int | None) -> tuple[list, dict]:
    from mlx_lm.generate import generate_step, speculative_generate_step

    p = mx.array(np.asarray(prompt, np.int32))
    it = generate_step(p, target, max_tokens=gen) if k is None else \
        speculative_generate_step(p, target, draft, num_draft_tokens=k, max_tokens=gen)
    ids, from_draft, t0 = [], 0, None
    for step in it:
        if t0 is None:
            t0 = time.perf_counter()
        ids.append(int(step[0]))
        from_draft += bool(step[2]) if k is not None else 0
    dt = time.perf_counter() - t0
    info = {"decode_tok_s": (len(ids) - 1) / dt, "gen": len(ids)}
    if k is not None:
        rounds = len(ids) - from_draft
        info.update(from_draft=from_draft, from_draft_share=from_draft / len(ids), rounds=rounds,
                    acceptance=from_draft / (k * rounds) if rounds else 0.0)
    return ids, info


def parts(target, draft, k: int, prompt) -> dict:
    """ms a step through the engine's own calls, on a row holding the prompt: the target's plain
    one-row step (64 pipelined steps, each read), then as chains of 64 launches with one read
    (draft_floor.py's method, so the two read alike) its (k + 1)-id verify (`feed`, margin k) and the
    draft's one-id step (DraftRows' engine, `feed` of one id: the split one-row step)."""
    from mlxcel_dist.engine.batch import BatchEngine
    from mlxcel_dist.engine.batch_spec import DraftRows

    ids = [int(x) for x in prompt]

    def chain(fn, n=64):
        mx.eval(fn())
        t = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        return (time.perf_counter() - t) / n * 1e3

    e = BatchEngine(target)
    e.add_many([(0, ids, None)])
    for _ in range(8):
        e.step()
    t = time.perf_counter()
    for _ in range(64):
        e.step()
    out = {"target_ms": (time.perf_counter() - t) / 64 * 1e3}
    v = BatchEngine(target, pipelined=False, margin=k)
    v.add_many([(0, ids, None)])
    v.step()
    block, at = mx.array([ids[-k - 1:]], mx.int32), [v.rows[0].pos]
    out["verify_ms"] = chain(lambda: v.feed(block, at))
    d = DraftRows(draft, k)
    d.add([(0, ids)])
    d.engine.step()
    one, at = mx.array([[ids[-1]]], mx.int32), [d.engine.rows[0].pos]
    out["draft_ms"] = chain(lambda: d.engine.feed(one, at))
    return {n: round(x, 3) for n, x in out.items()}


def floor_model(weights: list, masked: bool = True):
    """The same arrays as draft_floor.py's MLX-calls-only model (q/k/v and gate/up concatenated, as it
    takes them; masked verify: the form MLX CUDA allows, sdpa_lengths.py), so its loop and ours read
    one pair."""
    import draft_floor as f

    w = dict(weights)
    if w["model.embed_tokens.weight"].shape[1] != f.H:  # --tiny: the floor model's widths follow
        f.H, f.NQ, f.NKV, f.D, f.I, f.V = (SHAPE[k] for k in ("hidden_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size"))
    f.LAYERS, f.DRAFT, f.THETA, f.EPS = SHAPE["num_hidden_layers"], DRAFT_LAYERS, SHAPE["rope_theta"], SHAPE["rms_norm_eps"]

    def L(i):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        return dict(ln1=w[f"model.layers.{i}.input_layernorm.weight"],
                    qkv=mx.concatenate([w[a + x + "_proj.weight"] for x in "qkv"]), o=w[a + "o_proj.weight"],
                    ln2=w[f"model.layers.{i}.post_attention_layernorm.weight"],
                    gu=mx.concatenate([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]), down=w[m + "down_proj.weight"])

    p = dict(embed=w["model.embed_tokens.weight"], layers=[L(i) for i in range(f.LAYERS)],
             norm=w["model.norm.weight"], head=w["lm_head.weight"])
    mx.eval(p)
    m = f.Model(p)
    m.masked = masked
    return f, m


def consistent(model, prompt, ids: list) -> float:
    """Share of `ids` that are the argmax of one full forward of `model` over the prompt and the ids before
    them (a loop's steps against the model's own prefill path: bf16 near-ties aside, 1.0)."""
    seq = along(prompt, ids)[None]
    return float(np.mean(np.array(model(seq)[0, len(prompt) - 1:].argmax(-1)) == np.array(ids)))


def checked_drafts(draft, k: int):
    """DraftRows recording each round's contexts and drafts, and `check()`: the share of drafts that are
    the draft model's argmax in one full forward over the context and the drafts before them."""
    from mlxcel_dist.engine.batch_spec import DraftRows

    rounds = []

    class Checked(DraftRows):
        def draft(self, rows, k):
            D, q = super().draft(rows, k)
            rounds.append(([list(r.context) for r in rows], D))
            return D, q

        def check(self):
            same = n = 0
            for ctxs, D in rounds:
                for c, d in zip(ctxs, np.array(D).tolist()):
                    seq = mx.array([[int(x) for x in c] + d[:-1]])
                    same += int(np.sum(np.array(draft(seq)[0, len(c) - 1:].argmax(-1)) == np.array(d)))
                    n += len(d)
            return same / max(n, 1)

    return Checked(draft, k)


def floor_agreement(f, m, prompt, ids: list) -> float:
    """agreement() by the MLX-calls-only model's own forward: its draft (first layers) against its target."""
    seq = along(prompt, ids)
    t, d = (np.array(m(seq, 0, n)[len(prompt) - 1:].argmax(-1)) for n in (f.LAYERS, f.DRAFT))
    return float(np.mean(t == d))


def same_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--alphas", default="0.05,0.1,0.2,0.4")
    ap.add_argument("--agree", type=float, default=0.7)
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--pair-only", action="store_true", help="no prompt-lookup runs (the chain model)")
    ap.add_argument("--parts", action="store_true", help="per rep, the steps' times first (`parts`)")
    ap.add_argument("--mlx-only", action="store_true",
                    help="per rep, draft_floor.py's MLX-calls-only loop on the same pair too (plain, K-draft rounds "
                         "with the masked verify)")
    ap.add_argument("--check", action="store_true",
                    help="per run, the share of ids (and drafts) that a full forward of the target (draft) gives")
    ap.add_argument("--prompt-per-rep", action="store_true",
                    help="rep r decodes from random prompt r (the pair's acceptance over several paths of ids)")
    ap.add_argument("--trace-steps", action="store_true",
                    help="time each of our drafted runs' steps: the slowest, their kind and kernels compiled")
    ap.add_argument("--fixed-first", action="store_true", help="run fixed K before k by cost")
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same construction (a check on a CPU)")
    a = ap.parse_args()
    if a.tiny:
        SHAPE.update(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=2048)
    from mlxcel_dist.engine.batch_spec import BatchDrafts, DraftRows

    out = open(a.json, "a") if a.json else None

    def emit(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    t = time.perf_counter()
    base = random_weights(SHAPE, 0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, SHAPE["vocab_size"], a.prompt).astype(np.int32)
    emit({"built_s": round(time.perf_counter() - t, 1), "params_b": sum(w.size for _, w in base) / 1e9})

    # the pair: the alpha whose draft agrees nearest --agree
    best = None
    for alpha in map(float, a.alphas.split(",")):
        w = scaled(base, DRAFT_LAYERS, alpha)
        target = ours(SHAPE, w)
        _, _, draft = draft_of(SHAPE, w)
        ag, ag_lp = agreement(target, draft, prompt, 64)
        emit({"alpha": alpha, "draft_agreement": round(ag, 3), "draft_agreement_bf16_logprobs": round(ag_lp, 3)})
        if best is None or abs(ag - a.agree) < abs(best[1] - a.agree):
            best = (alpha, ag, w)
        del target, draft
    alpha, _, w = best
    target = ours(SHAPE, w)
    dcfg, dweights, draft = draft_of(SHAPE, w)
    emit({"pair_alpha": alpha})

    configs = {"plain": lambda: None,
               f"draft K={a.k}": lambda: BatchDrafts(a.k, DraftRows(draft, a.k)),
               f"draft K={a.k} fixed": lambda: BatchDrafts(a.k, (checked_drafts(draft, a.k) if a.check else
                                                                 DraftRows(draft, a.k)), adaptive=False)}
    if a.fixed_first:  # which drafted run meets new shapes first (the draft's and the verify's kernel compiles)
        configs = dict(sorted(configs.items(), key=lambda kv: "fixed" not in kv[0] and kv[0] != "plain"))
    fl = floor_model(w) if a.mlx_only else None
    plain_ids = None
    for rep in range(a.reps):
        if a.prompt_per_rep and rep:  # another random prompt: another path of greedy ids, another acceptance
            prompt = np.random.default_rng(rep).integers(0, SHAPE["vocab_size"], a.prompt).astype(np.int32)
            plain_ids = None
        if a.parts:
            emit({"model": "pair", "rep": rep, "parts": parts(target, draft, a.k, prompt)})
        for name, make in configs.items():
            spec = make()
            ids, info = generate(target, prompt, a.gen, spec, a.trace_steps)
            if a.check:
                info["ids_as_a_full_forward"] = round(consistent(target, prompt, ids), 4)
                if hasattr(getattr(spec, "draft", None), "check"):
                    info["drafts_as_a_full_forward"] = round(spec.draft.check(), 4)
            if name == "plain":
                plain_ids = plain_ids or ids
            if (name == "plain" and fl) or a.check:  # drafts pay by how often the draft agrees along the ids made
                info.update(draft_agreement_on_its_ids=round(agreement(target, draft, prompt, 0, ids)[0], 3),
                            distinct_ids=len(set(ids)))
            emit({"model": "pair", "rep": rep, "config": name, **info,
                  "same_as_plain": ids == plain_ids})
        if fl:  # the same pair in MLX calls only (its loops return the ids after the first one)
            f, m = fl
            f_ids, f_tps = f.plain(m, mx.array(prompt), a.gen)
            d_ids, d_tps, acc, E = f.drafted(m, mx.array(prompt), a.gen, a.k)
            own = [plain_ids[0], *f_ids]  # (its first id, the prompt's argmax, taken as ours: the same forward)
            emit({"model": "pair", "rep": rep, "config": "mlx-only plain", "decode_tok_s": f_tps,
                  "prefix_same_as_ours_plain": same_prefix(f_ids, plain_ids[1:]),
                  "draft_agreement_on_its_ids": round(agreement(target, draft, prompt, 0, own)[0], 3),
                  "its_draft_agreement_by_itself": round(floor_agreement(f, m, prompt, own), 3),
                  "distinct_ids": len(set(own))})
            emit({"model": "pair", "rep": rep, "config": f"mlx-only draft K={a.k} masked", "decode_tok_s": d_tps,
                  "acceptance": acc, "ids_a_round": E, "same_as_its_plain": d_ids == f_ids,
                  "its_draft_agreement_by_itself": round(floor_agreement(f, m, prompt, [plain_ids[0], *d_ids]), 3)})

    if not a.no_mlx_lm:
        mt = mlx_lm_model(SHAPE, w)
        md = mlx_lm_model(dcfg, dweights)
        m_plain = None
        for rep in range(2):
            for k in (None, a.k):
                ids, info = mlx_lm_run(mt, md, prompt, a.gen, k)
                if k is None:
                    m_plain = ids
                emit({"model": "pair", "rep": rep, "config": "mlx-lm " + ("plain" if k is None else f"draft K={k}"),
                      **info, "same_as_its_plain": ids == m_plain,
                      "prefix_same_as_ours_plain": same_prefix(ids, plain_ids), "first": ids[:4], "ours_first": plain_ids[:4]})
        del mt, md
    del target
    if a.pair_only:
        return

    # the chain: lookup on a text with no repeats and on one it continues verbatim
    cw = scaled(base, 0, 1e-5)
    chain = ours(SHAPE, cw)
    made, _ = generate(chain, prompt[:1], 200)
    made = [int(prompt[0])] + made
    texts = {"miss": prompt, "verbatim": np.asarray(made + made[:24], np.int32)}
    for rep in range(a.reps):
        for text, p in texts.items():
            ref = None
            for name, make in (("plain", lambda: None), (f"lookup K={a.k}", lambda: BatchDrafts(a.k)),
                               (f"lookup K={a.k} fixed", lambda: BatchDrafts(a.k, adaptive=False))):
                ids, info = generate(chain, p, a.gen, make())
                ref = ref or ids
                row = {"model": "chain", "text": text, "rep": rep, "config": name, **info, "same_as_plain": ids == ref}
                if text == "verbatim":
                    row["continues_verbatim"] = same_prefix(ids, made[24:])
                emit(row)


if __name__ == "__main__":
    main()
