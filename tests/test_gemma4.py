"""Gemma 4 specifics the per-family runners cannot see: config forms and
their refusals, the checkpoint names sanitize maps or drops, the shared-KV
caches, and how the MoE experts and partial attention blocks are split."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.cache import SharedKVCache
from mlxcel_dist.parallel.collectives import Group
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, compare
from mlxcel_dist.checkpoint.loader import load_model
from mlxcel_dist.models.gemma4 import Model, ModelArgs
from mlxcel_dist.parallel.shard import collect_plan

from reference_cases import FIXTURES

DENSE = FIXTURES / "gemma4" / "dense_fp32"
MOE = FIXTURES / "gemma4" / "moe_fp32"


def _config(d):
    return json.loads((d / "config.json").read_text())


def test_published_config_form_loads_the_same_model(tmp_path):
    # config_t4.json: global_head_dim / num_global_key_value_heads (the published
    # checkpoints) instead of transformers 5.24's per_layer_config.
    for d in (DENSE, MOE):
        a = ModelArgs.from_dict(_config(d))
        b = ModelArgs.from_dict(json.loads((d / "config_t4.json").read_text()))
        assert "per_layer_config" not in json.loads((d / "config_t4.json").read_text())
        assert a.layer_heads == b.layer_heads and a.kv_source == b.kv_source
        out = tmp_path / d.name
        shutil.copytree(d, out)
        shutil.copyfile(d / "config_t4.json", out / "config.json")
        ref = np.load(d / "reference.npz")
        got = np.array(load_model(out).model(mx.array(ref["ids"])[None])[0])
        assert compare(got, ref["logits"], FP32_REL_TOL)["ok"]


def test_layer_shapes_and_kv_sources():
    a = ModelArgs.from_dict(_config(DENSE))
    # full layers: their own head_dim and KV heads (k = v gates num_global_key_value_heads)
    assert a.layer_heads == [(16, 2), (16, 2), (32, 1), (16, 2), (16, 2), (32, 1)]
    assert a.kv_source == [None, None, None, None, 3, 2]  # the last earlier layer of their kind
    m = ModelArgs.from_dict(_config(MOE))
    assert m.layer_heads[1] == (32, 2)  # no k = v: the sliding KV-head count
    # without k = v, num_global_key_value_heads does not apply (as transformers)
    cfg = {k: v for k, v in _config(MOE).items() if k != "per_layer_config"}
    cfg.update(global_head_dim=32, num_global_key_value_heads=1)
    assert ModelArgs.from_dict(cfg).layer_heads[1] == (32, 2)


@pytest.mark.parametrize("edit,match", [
    (dict(use_bidirectional_attention="all"), "bidirectional"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
    # layers 2.. share, but layers 0-1 hold no full layer to read from
    (dict(num_kv_shared_layers=4), "no earlier layer"),
    (dict(per_layer_config={"2": {"head_dim": 32, "intermediate_size": 8}}), "intermediate_size"),
    (dict(per_layer_config={"full": {"head_dim": 32}}), "not a layer index"),
    (dict(per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 64}}), "different head shapes"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "factor": 2.0},
                           "full_attention": {"rope_type": "default"}}), "yarn"),
    (dict(enable_moe_block=True, num_experts=4), "moe_intermediate_size"),
])
def test_config_refusals(edit, match):
    cfg = {**_config(DENSE), **edit}
    with pytest.raises(UserError, match=match):
        ModelArgs.from_dict(cfg)


def test_last_layer_forced_to_full_as_transformers():
    cfg = {**_config(DENSE), "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    cfg["layer_types"][-1] = "sliding_attention"
    cfg["layer_types"][2] = "full_attention"
    cfg.pop("per_layer_config")
    assert ModelArgs.from_dict(cfg).layer_types[-1] == "full_attention"


def test_sanitize_maps_multimodal_names_and_drops_towers_and_shared_kv_weights():
    m = Model(ModelArgs.from_dict(_config(FIXTURES / "gemma4" / "multimodal_fp32")))
    w = mx.zeros((1,))
    got = m.sanitize({
        "model.language_model.layers.0.self_attn.q_proj.weight": w,
        "model.language_model.layers.4.self_attn.k_proj.weight": w,  # a shared-KV layer: transformers ignores it
        "model.language_model.layers.5.self_attn.v_norm.weight": w,
        "model.language_model.layers.3.self_attn.k_proj.weight": w,  # layer 3 holds its own KV
        "model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight": w,
        "model.embed_vision.embedding_projection.weight": w,
        "model.audio_tower.x.weight": w,
        "model.embed_audio.embedding_projection.weight": w,
        "lm_head.weight": w,  # tied
    })
    assert sorted(got) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"]


def test_shared_kv_layers_hold_no_cache_of_their_own():
    model = load_model(DENSE).model
    cache = model.make_cache()
    assert [type(c).__name__ for c in cache][4:] == ["SharedKVCache", "SharedKVCache"]
    assert [c.reads_layer for c in cache] == [None, None, None, None, 3, 2]
    ids = np.load(DENSE / "reference.npz")["ids"]
    model(mx.array(ids[:20])[None], cache)
    for c in cache[4:]:
        # nothing of its own; its queries sit where its source's update began
        assert isinstance(c, SharedKVCache) and c.state == [] and c.offset == 0 and c.source.offset == 20
    # a cache-less forward makes its caches (the shared layers' KV travels through them)
    want = np.array(model(mx.array(ids)[None])[0])
    assert compare(want, np.load(DENSE / "reference.npz")["logits"], FP32_REL_TOL)["ok"]


def test_sharding_splits_experts_by_halves_and_partial_attention_blocks():
    plans = []
    for r in range(2):
        m = Model(ModelArgs.from_dict(_config(MOE)))
        m.shard(Group.planned(2, r))
        plans.append(collect_plan(m))
        ex = m.layers[0].experts
        assert ex.gate_up_proj.weight.shape == (4, 16, 32) and ex.down_proj.weight.shape == (4, 32, 8)
        assert not ex.group.single
        assert "k_proj" not in m.layers[3].self_attn and m.layers[3].self_attn.num_kv_heads == 1
        assert m.layers[0].router.proj.weight.shape == (4, 32)  # replicated
    # gate rows [r*I/2, (r+1)*I/2) and the same rows of the up half; down columns alike
    assert plans[1]["model.layers.0.experts.gate_up_proj.weight"] == (1, [(8, 16), (24, 32)])
    assert plans[1]["model.layers.0.experts.down_proj.weight"] == (2, [(8, 16)])
    # shared-KV layer: q/o only; source layer 2 (sliding): k and v
    assert "model.layers.3.self_attn.q_proj.weight" in plans[0]
    assert not any(k.startswith("model.layers.3.self_attn.k_proj") for k in plans[0])
    d = Model(ModelArgs.from_dict(_config(DENSE)))
    d.shard(Group.planned(2, 1))
    attn = d.layers[2].self_attn  # k = v, 1 KV head: replicated
    assert "v_proj" not in attn and attn.num_kv_heads == 1 and attn.num_heads == 2
    assert collect_plan(d)["model.layers.2.self_attn.k_proj.weight"] == (0, [(0, 32)])
    assert d.model.embed_tokens_per_layer.weight.shape == (256, 48)  # replicated


def test_collectives_plan_counts_both_branches():
    m = Model(ModelArgs.from_dict(_config(MOE)))
    m.shard(Group.planned(2, 0))
    calls, nbytes = m.collectives_per_token()["all_sum"]
    assert calls == 5 * 3  # per layer: o_proj, dense down_proj, experts
    assert nbytes == 5 * 3 * 32 * 4
