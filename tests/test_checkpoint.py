"""One reading of a checkpoint: MODEL resolves once into a Checkpoint whose
config and tensor headers the CLI's checks and the loader share."""

import json
import shutil

import pytest

from mlxcel_dist.checkpoint import loader
from mlxcel_dist.checkpoint.loader import check_shardable, default_model_dir, load_model, open_model


def test_read_once_and_shared(tmp_path, monkeypatch):
    d = tmp_path / "m"
    shutil.copytree(default_model_dir(), d)
    calls = {"config": 0, "headers": 0}
    read_config, open_checkpoint = loader.read_config, loader.open_checkpoint

    def counted_config(p):
        calls["config"] += 1
        return read_config(p)

    def counted_headers(p):
        calls["headers"] += 1
        return open_checkpoint(p)

    monkeypatch.setattr(loader, "read_config", counted_config)
    monkeypatch.setattr(loader, "open_checkpoint", counted_headers)
    ck = open_model(str(d))
    check_shardable(str(d), 2)  # every rank on paper
    check_shardable(str(d), 3)
    loaded = load_model(str(d))
    assert open_model(str(d)) is ck and loaded.model_dir == ck.dir
    assert calls == {"config": 1, "headers": 1}
    assert ck.context_length == 512 and ck.quantization is None
    assert sum(ck.tensor_bytes().values()) == 4 * sum(int(p.size) for p in _leaves(loaded.model))


def test_a_changed_checkpoint_is_read_again(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(default_model_dir(), d)
    ck = open_model(str(d))
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    again = open_model(str(d))
    assert again is not ck and again.context_length == 256


def _leaves(model):
    from mlx.utils import tree_flatten

    return [p for _, p in tree_flatten(model.parameters())]


def test_an_open_checkpoint_holds_one_descriptor_per_file(tmp_path):
    # a map per tensor held a descriptor each: thousands for the fixtures, ~90k for a per-expert DeepSeek-V3
    import os

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counts descriptors in /proc/self/fd (Linux)")

    import mlx.core as mx
    import numpy as np

    from mlxcel_dist.checkpoint.weights import open_checkpoint

    w = {f"t{i}": mx.array(np.full((3, 2), i, np.float32)) for i in range(300)}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)
    before = len(os.listdir("/proc/self/fd"))
    refs = open_checkpoint(tmp_path)
    assert len(os.listdir("/proc/self/fd")) - before <= 1
    assert [int(refs[f"t{i}"].read()[1, 1].item()) for i in (0, 7, 299)] == [0, 7, 299]
