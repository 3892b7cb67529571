"""The model contract (models/base.py's LanguageModel): every family's Model
declares its capabilities (stage, own_loop, split_decode, pipeline_stages,
kv_bits_refused, ...) and they say what the model is, so callers read them
instead of probing with getattr."""

from __future__ import annotations

import inspect

import pytest

from mlxcel_dist.engine.decode import splittable
from mlxcel_dist.checkpoint.loader import open_model
from mlxcel_dist.models import get_model_module, supported
from mlxcel_dist.models.base import CausalLM, DecoderStack, LanguageModel
from mlxcel_dist.parallel.pipeline import REFUSED
from reference_cases import cases

FAMILIES = sorted({get_model_module(t).__name__.rsplit(".", 1)[-1] for t in supported()})


def _case(family: str):
    found = [d for d in cases(family) if "fp32" in d.name] or cases(family)
    return found[0] if found else None


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_declares_the_contract(family):
    d = _case(family)
    if d is None:
        pytest.skip(f"no fixture of {family}")
    m, _ = open_model(d).build(with_refs=False)  # lazy: nothing is read
    cls = type(m)
    assert isinstance(m, CausalLM) and isinstance(m, LanguageModel), cls.__mro__
    assert m.stage is None  # not cut into a pipeline stage
    for name in ("own_loop", "split_decode", "pipeline_stages"):
        assert type(getattr(cls, name)) is bool, name
    assert cls.kv_bits_refused is None or (isinstance(cls.kv_bits_refused, str) and cls.kv_bits_refused)
    # own_loop is exactly "generate_ids is its generation loop"
    assert cls.own_loop == inspect.isfunction(getattr(cls, "generate_ids", None))
    # split_decode: declared only where every layer has the pieces decode splits at
    assert not cls.split_decode or splittable(m)
    # pipeline_stages: declared, or refused with a reason, never both
    assert cls.pipeline_stages != (family in REFUSED)
    if cls.pipeline_stages:
        assert isinstance(m.model, DecoderStack)  # the stack pipeline.make_stage cuts
        cuts = m.stage_cuts()
        assert cuts is None or all(0 < c < len(m.model.layers) for c in cuts)
    lines = m.describe_layers()
    assert len(lines) == m.args.num_hidden_layers and all(isinstance(x, str) for x in lines)
    assert m.kv_options is None and m.engine is None
