"""step3p5: what the per-family runners do not see.

- the multimodal `step3p7` config form (text under text_config, vision tower
  and projector tensors present) loads the same decoder and gives the
  reference's logits;
- a checkpoint in transformers' names and the same one in the hub layout
  sanitize to the same tensors (gate_up_proj split into gate/up rows);
- config refusals are one clear UserError.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_dist.engine.generation import sequence_logits
from mlxcel_dist.errors import UserError
from mlxcel_dist.harness import FP32_REL_TOL, compare
from mlxcel_dist.checkpoint.loader import build_model, load_model
from mlxcel_dist.checkpoint.weights import open_checkpoint

FIX = Path(__file__).parent / "fixtures" / "step3p5"


def test_multimodal_config_form_loads_the_text_decoder(tmp_path):
    src = FIX / "hub_layout_fp32"
    text = json.loads((src / "config.json").read_text())
    cfg = {"model_type": "step3p7", "architectures": ["Step3p7ForConditionalGeneration"],
           "text_config": {**text, "model_type": "step3p5"}, "vision_config": {"hidden_size": 16}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # the text tensors plus a vision tower and projector as the hub stores them
    weights = dict(mx.load(str(src / "model.safetensors")))
    weights["vision_model.conv1.weight"] = mx.zeros((16, 3, 14, 14))
    weights["vit_large_projector.weight"] = mx.zeros((32, 64))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    model = load_model(tmp_path).model
    assert model.args.model_type == "step3p7" and model.args.heads == [4, 8, 4, 8]
    ref = np.load(src / "reference.npz")
    res = compare(sequence_logits(model, ref["ids"]), ref["logits"], FP32_REL_TOL)
    assert res["ok"], res


def test_transformers_names_and_hub_layout_sanitize_alike():
    d = FIX / "moe_fp32"
    model = build_model(json.loads((d / "config.json").read_text()))
    refs = open_checkpoint(d)
    assert any(".mlp.experts.gate_up_proj" in n for n in refs)
    ours = model.sanitize(refs)
    E, I, H = 8, 16, 32
    name = "model.layers.2.moe."
    gate, up = ours[name + "gate_proj.weight"], ours[name + "up_proj.weight"]
    assert gate.shape == up.shape == (E, I, H)
    whole = refs["model.layers.2.mlp.experts.gate_up_proj"].read()
    assert mx.array_equal(gate.read(), whole[:, :I]) and mx.array_equal(up.read(), whole[:, I:])
    # a rank's slice of the split tensor reads the same rows of the stored one
    assert mx.array_equal(gate.read(1, [(4, 8)]), whole[:, 4:8]) and mx.array_equal(up.read(1, [(4, 8)]), whole[:, 20:24])
    assert mx.array_equal(up.read(2, [(0, 5)]), whole[:, I:, :5])
    assert {name + "router_bias", name + "gate.weight", name + "down_proj.weight",
            "model.layers.2.share_expert.down_proj.weight"} <= ours.keys()
    assert not any(".mlp.experts." in n or "shared_experts" in n or ".mlp.gate." in n for n in ours)
    # names only (what quant.py passes): the same renames
    assert sorted(model.sanitize(dict.fromkeys(refs))) == sorted(ours)


def _config(**over):
    d = json.loads((FIX / "moe_fp32" / "config.json").read_text())
    d.update(over)
    return d


@pytest.mark.parametrize("over,message", [
    ({"gating": "elementwise"}, "per-head attention gate"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"swiglu_limits": [1.0]}, "swiglu_limits has 1 entries"),
    ({"rope_parameters": None, "rope_theta": [1.0, 2.0, 3.0, 2.0, 1.0]}, "rope_theta differs between"),
    ({"attention_other_setting": {"num_attention_groups": 4}}, "attention_other_setting"),
])
def test_config_refusals(over, message):
    with pytest.raises(UserError, match=message):
        build_model(_config(**over))


def test_legacy_hub_config_trims_mtp_padding():
    args = build_model(json.loads((FIX / "hub_layout_fp32" / "config.json").read_text())).args
    assert args.num_nextn_predict_layers == 1 and len(args.layer_types) == 4
    assert args.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert args.rope["full_attention"]["partial_rotary_factor"] == 0.5
