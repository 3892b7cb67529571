#!/usr/bin/env python
"""Tiny random Baichuan-M1 reference fixtures (tests/fixtures/baichuan_m1/<case>/).

    .venv/bin/python scripts/fixtures_baichuan_m1.py   (or scripts/make_fixtures.py --family baichuan_m1)

transformers has no Baichuan-M1: the checkpoints are written and the reference
logits computed by scripts/baichuan_m1_reference.py, a float64 port of the
ONE full forward pass of the original modeling_baichuan.py (its docstring says
what it follows, and why its incremental path is not ported: it is wrong for
a multi-token chunk on a cache; every feeding mode here compares against the
one pass). Checkpoints are in the original's layout (`W_pack`, `conv_k`,
`conv_v`, NormHead `lm_head.weight`) and config keys.

Before the cases are written, the port is cross-checked where it degenerates
to a transformers model: with identity convs (kernel [0, ..., 0, 1]: the
current token passes through) and unit-norm lm_head rows, a port whose layers
are all sliding equals MistralForCausalLM, and one whose layers are all full
equals LlamaForCausalLM, on the same weights (W_pack split into q/k/v). The
measured differences go into the README; the script fails past CROSSCHECK_TOL.

Features per case: full and sliding layers with their own head counts (so
their own head_dims), the causal conv over k and v per KV head (window 2 as
released, and 3), NormHead, RoPE, RMSNorm, SwiGLU. Head counts split at np 2
and 4, with KV heads fewer than ranks in some layer kinds.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from baichuan_m1_reference import BaichuanM1Config, BaichuanM1ForCausalLM, heads_of
from fixture_lib import (
    BASE_COLUMNS,
    SIZES,
    Family,
    Readme,
    Rule,
    anything,
    endswith,
    full_logits,
    is_embedding,
    no_window,
    npz_keys,
    reinit_,
    rel_change,
    run,
)

INIT = dict(embed_std=0.2, linear_std=0.15, head_std=0.3, norm_mean=1.0, norm_std=0.3, conv_mean=0.5, conv_std=0.4)
INIT_RULES = (
    Rule(is_embedding, "embed_std"),
    Rule(endswith("norm.weight"), "norm_std", ("norm_mean",)),
    Rule(endswith("conv_k", "conv_v"), "conv_std", ("conv_mean",)),
    Rule(lambda name, p: name.startswith("lm_head."), "head_std"),
    Rule(anything, "linear_std"),
)
COMMON = dict(rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, model_max_length=512)
# max |port - transformers| / std(logits), both in float64 (transformers' RoPE tables are float32, as the port's)
CROSSCHECK_TOL = 1e-9


def identity_conv(m) -> None:
    """Conv kernels [0, ..., 0, 1]: every k and v is the current token's."""
    for layer in m.model.layers:
        for p in (layer.self_attn.conv_k, layer.self_attn.conv_v):
            p.zero_()
            p[..., -1] = 1.0


def plain_head(m) -> dict:
    """The head without NormHead's row normalisation."""
    return {"norm_head": False}


ABLATIONS = {"identity_conv": identity_conv, "no_norm_head": plain_head, "no_sliding_window": no_window}

CASES = [
    dict(
        name="gqa_fp32",
        description=(
            "full layers 4 q / 2 kv (head_dim 16), sliding layers 8 q / 4 kv (head_dim 8) as the released "
            "(odd layers sliding), window 8, conv_window 2, theta 1e6, 4 layers"
        ),
        seed=16001,
        T=48,
        config=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_swa_attention_heads=8,
            num_swa_key_value_heads=4,
            sliding_window=8,
            sliding_window_layers=[1, 3],
            conv_window=2,
            rope_theta=1_000_000.0,
        ),
        ablations=ABLATIONS,
    ),
    dict(
        name="mqa_conv3_fp32",
        description=(
            "full layers 4 q / 1 kv (head_dim 16), sliding layers 4 q / 2 kv, layers (s, f, s), window 16, "
            "conv_window 3 (state of 2 tokens), theta 10000"
        ),
        seed=16002,
        T=64,
        config=dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_swa_attention_heads=4,
            num_swa_key_value_heads=2,
            sliding_window=16,
            sliding_window_layers=[0, 2],
            conv_window=3,
            rope_theta=10_000.0,
        ),
        ablations=ABLATIONS,
        notes=["conv_window 3: the original asserts conv_window == 2 (its decode branch handles 2 only); "
               "its one-pass convolution, ported here, is defined for any window"],
    ),
]


# --------------------------------------------------------------------------- cross-check against transformers


def _crosscheck(all_sliding: bool, seed: int) -> tuple[float, float]:
    """max |port - transformers| / std on a port with identity convs and unit
    head rows, all layers sliding (vs Mistral) or all full (vs Llama):
    (transformers in float64, transformers in float32)."""
    L, W, T = 3, 8, 3 * 8 + 7
    H, KV = (8, 2) if all_sliding else (4, 1)
    kw = {**SIZES, **COMMON, "num_hidden_layers": L, "sliding_window": W, "rope_theta": 50_000.0}
    cfg = BaichuanM1Config(**kw, num_attention_heads=H, num_key_value_heads=KV, num_swa_attention_heads=H,
                           num_swa_key_value_heads=KV, conv_window=2,
                           sliding_window_layers=list(range(L)) if all_sliding else [])
    port = BaichuanM1ForCausalLM(cfg).eval()
    reinit_(port, seed, INIT, INIT_RULES)
    with torch.no_grad():
        identity_conv(port)
        port.lm_head.weight.copy_(torch.nn.functional.normalize(port.lm_head.weight))
    D = cfg.hidden_size // H
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV, head_dim=D,
                  rms_norm_eps=cfg.rms_norm_eps, hidden_act="silu", tie_word_embeddings=False,
                  max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if all_sliding:
        hf = MistralForCausalLM(MistralConfig(**common, sliding_window=W))
    else:
        hf = LlamaForCausalLM(LlamaConfig(**common))
    hf.config._attn_implementation = "eager"
    sd = {}
    for name, p in port.state_dict().items():
        if name.endswith("W_pack.weight"):
            pre = name.removesuffix("W_pack.weight")
            q, k, v = p.split([H * D, KV * D, KV * D])
            sd.update({pre + "q_proj.weight": q, pre + "k_proj.weight": k, pre + "v_proj.weight": v})
        elif not name.endswith(("conv_k", "conv_v")):
            sd[name] = p
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary_emb" in n for n in missing), (missing, unexpected)
    hf.eval()
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=T).astype(np.int32)
    x = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad():
        got = port(input_ids=x).logits[0].numpy()
        ref32 = hf(input_ids=x).logits[0].numpy().astype(np.float64)
        # transformers computes eager softmax and RMSNorm in float32 even for float64
        # inputs: sdpa, and the norms' formula in float64, give its float64 answer.
        hf.config._attn_implementation = "sdpa"
        for m in hf.modules():
            if hasattr(m, "variance_epsilon"):
                m.forward = lambda x, m=m: m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))
        hf.to(torch.float64)
        # the port renormalises the (float32-rounded unit) rows in float64: give transformers those rows
        hf.lm_head.weight.copy_(torch.nn.functional.normalize(hf.lm_head.weight))
        ref64 = hf(input_ids=x).logits[0].numpy()
    return rel_change(got, ref64), rel_change(got, ref32)


@functools.lru_cache(maxsize=None)
def crosscheck() -> tuple[str, ...]:
    notes = []
    for all_sliding, seed in ((True, 16101), (False, 16102)):
        d64, d32 = _crosscheck(all_sliding, seed)
        what = "all layers sliding (window 8) == MistralForCausalLM" if all_sliding else \
            "all layers full == LlamaForCausalLM"
        print(f"cross-check: {what}: max|diff|/std = {d64:.2e} (float64), {d32:.2e} (transformers float32)")
        assert d64 < CROSSCHECK_TOL, f"the port disagrees with transformers ({what}): {d64:.2e}"
        notes.append(
            f"Cross-check of the port (identity conv, unit-norm head rows, 3 layers, T=31): {what} on the same "
            f"weights (W_pack split into q/k/v), max |diff| / std = {d64:.1e} with transformers in float64 (sdpa, norms in float64) "
            f"(asserted < {CROSSCHECK_TOL:g} whenever this script runs), {d32:.1e} with transformers in float32 (eager)."
        )
    return tuple(notes)


def crosscheck_notes(ctx) -> list[str]:
    """The cross-check runs with the first case (also under make_fixtures.py); its notes go there."""
    notes = crosscheck()
    return list(notes) if ctx.case["name"] == CASES[0]["name"] else []


def config_layer_types(i, c) -> str:
    n = c["config"]["num_hidden_layers"]
    return "".join("s" if j in c["config"]["sliding_window_layers"] else "f" for j in range(n))


FAMILY = Family(
    "baichuan_m1",
    __file__,
    BaichuanM1ForCausalLM,
    BaichuanM1Config,
    CASES,
    common=COMMON,
    init=INIT,
    init_rules=INIT_RULES,
    extra_outputs=crosscheck_notes,
    info_fields=(npz_keys,),
    readme=Readme(
        title="Baichuan-M1",
        runtime="float64 port of the original modeling_baichuan.py (scripts/baichuan_m1_reference.py), CPU.",
        about=(
            "transformers has no Baichuan-M1: `reference.npz` (`ids` int32 [T], `logits` float32 [T, V]) holds the",
            "float64 port's ONE full forward pass (no cache), rounded to float32. The original's own incremental",
            "path is wrong for multi-token chunks on a cache (it treats any chunk after the first as one decode",
            "token: the conv is dropped after the chunk's first token); the one pass wins, and every feeding mode",
            "(one pass, chunks, decode) is compared against it. `fixture_info.json`: statistics, ablations, notes.",
        ),
        columns=BASE_COLUMNS + (
            ("layers (s/f)", config_layer_types),
            ("ablations (max abs change / std)",
             lambda i, c: ", ".join(f"{k} {v}" for k, v in i["ablation_max_rel_change"].items())),
        ),
    ),
    readme_notes=(
        "The sliding window: query i attends keys j with i - window < j <= i (flash-attn window_size "
        "(window - 1, 0) in the original).",
    ),
)


if __name__ == "__main__":
    sys.exit(run(FAMILY))
