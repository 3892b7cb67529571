"""Gemma 3n specifics the per-family runners do not see: config forms and
their refusals, which layers read which layer's KV, what sanitize drops, and
the sparsity statistics' collective in the per-token plan."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlxcel_dist.cache import SharedKVCache
from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.errors import UserError
from mlxcel_dist.models.gemma3n import Model, ModelArgs

FIX = Path(__file__).parent / "fixtures" / "gemma3n"


def _text(**over):
    # google/gemma-3n-E2B's text_config shape (transformers-4.53 form), shrunk where it does not matter.
    cfg = dict(
        model_type="gemma3n_text", vocab_size=262400, vocab_size_per_layer_input=262144, hidden_size=2048,
        hidden_size_per_layer_input=256, intermediate_size=[8192] * 30, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(30)],
        num_kv_shared_layers=10, activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=None, final_logit_softcapping=30.0,
    )  # fmt: skip
    cfg.update(over)
    return cfg


def test_e2b_config_forms_and_kv_sources():
    # The last 10 of 30 layers read the last earlier layer of their kind
    # (18: sliding, 19: full), as transformers' kv_sharing_modes.
    for params in (_text(), {"model_type": "gemma3n", "text_config": _text(),
                             "vision_config": {"vocab_offset": 262144, "vocab_size": 128, "hidden_size": 2048},
                             "audio_config": {"vocab_offset": 262272, "vocab_size": 128, "hidden_size": 1536}}):
        a = ModelArgs.from_dict(params)
        assert a.kv_source[:20] == [None] * 20
        assert a.kv_source[20:] == [19 if (i + 1) % 5 == 0 else 18 for i in range(20, 30)]
        assert a.rope["full_attention"]["rope_theta"] == 1_000_000.0
        assert a.rope["sliding_attention"]["rope_theta"] == 10_000.0
    assert a.embedders == {"embed_vision": (262144, 128, 2048, 1e-6), "embed_audio": (262272, 128, 1536, 1e-6)}


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(activation_sparsity_pattern=[0.95] * 29), "one value per layer"),
        (dict(activation_sparsity_pattern=0.95), "one value per layer"),
        (dict(activation_sparsity_pattern=[1.0] * 30), r"\[0, 1\)"),
        (dict(intermediate_size=[8192] * 3), "intermediate_size has 3 entries"),
        (dict(num_kv_shared_layers=30), "num_kv_shared_layers"),
        # the shared range holds a full layer, the layers before it none
        (dict(layer_types=["sliding_attention"] * 25 + ["full_attention"] * 5, num_kv_shared_layers=5),
         "no earlier layer"),
        (dict(layer_types=["bidirectional"] * 30), "unsupported kinds"),
    ],
)
def test_config_refusals(over, match):
    with pytest.raises(UserError, match=match):
        ModelArgs.from_dict(_text(**over))


def test_multimodal_config_needs_its_embedder_ranges():
    with pytest.raises(UserError, match="audio_config"):
        ModelArgs.from_dict({"model_type": "gemma3n", "text_config": _text(),
                             "vision_config": {"vocab_offset": 1, "vocab_size": 1, "hidden_size": 8}})


def test_sanitize_maps_multimodal_names_and_drops_what_is_never_used():
    args = ModelArgs.from_dict(json.loads((FIX / "multimodal_fp32" / "config.json").read_text()))
    m = Model(args)
    w = mx.zeros((1,))
    got = m.sanitize({
        "model.language_model.layers.0.self_attn.k_proj.weight": w,  # layer 0 computes its KV: kept
        "model.language_model.layers.3.self_attn.k_proj.weight": w,  # shared layers: never used
        "model.language_model.layers.4.self_attn.v_norm.weight": w,
        "model.language_model.layers.4.self_attn.q_proj.weight": w,
        "model.vision_tower.timm_model.blocks.0.weight": w,
        "model.audio_tower.conformer.0.weight": w,
        "model.embed_vision.embedding.weight": w,
        "model.embed_audio.soft_embedding_norm.weight": w,  # embeds tower outputs only
        "lm_head.weight": w,  # tied
        "model.language_model.something_new.weight": w,  # unknown: kept, so the strict load names it
    })  # fmt: skip
    assert sorted(got) == [
        "model.embed_vision.embedding.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.4.self_attn.q_proj.weight",
        "model.something_new.weight",
    ]


def test_caches_and_layer_kinds():
    args = ModelArgs.from_dict(json.loads((FIX / "gqa_fp32" / "config.json").read_text()))
    m = Model(args)
    cache = m.make_cache()
    assert [c.reads_layer for c in cache] == [None, None, None, 1, 1, 2]
    assert all(isinstance(c, SharedKVCache) and c.source is cache[c.reads_layer] for c in cache[3:])
    lines = m.describe_layers()
    assert "shared-KV (reads layer 2)" in lines[5] and "activation sparsity 0.95" in lines[0]


@pytest.mark.parametrize("n", [2, 4])
def test_sparse_layers_add_one_small_all_sum_each(n):
    # gqa_fp32: 6 layers (o_proj + down_proj each), 4 of them sparse: one
    # [1, 1, 3] float32 all_sum more each under TP, none at np 1.
    args = ModelArgs.from_dict(json.loads((FIX / "gqa_fp32" / "config.json").read_text()))
    single = Model(args)
    assert single.collectives_per_token()["all_sum"] == (0, 0)
    m = Model(args)
    m.shard(Group.planned(n, 0))
    calls, nbytes = m.collectives_per_token()["all_sum"]
    assert calls == 6 * 2 + 4
    assert nbytes == 6 * 2 * args.hidden_size * 4 + 4 * 3 * 4
