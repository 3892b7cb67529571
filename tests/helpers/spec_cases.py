"""Rank job for test_spec's np N test: per case, plain greedy ids and
drafted ones (tests/spec_drafts.py's scripted drafts), in one launch; then,
on the gemma3 case, a draft model (the target's twin, misled at one index a
round) and prompt lookup; every family whose layers hold attention KV.

usage (under the launcher): spec_cases.py OUT_DIR CASE_DIR ...
Rank 0 writes OUT_DIR/<family>__<case>.npz (plain, scripted, accepted,
expected) and OUT_DIR/draft_model.npz (plain, draft, lookup, accepted,
expected).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: spec_drafts

import mlxcel_dist.engine.batch as batch  # noqa: E402
from mlxcel_dist.parallel import distributed  # noqa: E402
from mlxcel_dist.checkpoint.loader import load_model  # noqa: E402
from mlxcel_dist.engine.batch_spec import BatchDrafts  # noqa: E402
from spec_drafts import ScriptedDrafts, misled, plain_ids, spec_ids  # noqa: E402

K, N = 3, 20


def main():
    out = Path(sys.argv[1])
    group = distributed.init_from_env()
    batch.CPU_STEP = 8
    cases = [Path(a) for a in sys.argv[2:]]
    for d in cases:
        model = load_model(d, group=group).model
        prompt = np.load(d / "reference.npz")["ids"][:3]
        want = plain_ids(model, prompt, N + K + 1, group, compiled=False)  # eager: no kernels to build per family
        drafts = ScriptedDrafts(want, len(prompt), K, model.args.vocab_size)
        got, stats = spec_ids(model, prompt, N, drafts, group, compiled=False)
        if group.is_root:
            np.savez(out / f"{d.parent.name}__{d.name}.npz", plain=want[:N], scripted=got, accepted=stats.accepted,
                     expected=drafts.expected)
    d = next(d for d in cases if d.parent.name == "gemma3")  # sliding and full layers
    model = load_model(d, group=group).model
    prompt = np.load(d / "reference.npz")["ids"][:3]
    want = plain_ids(model, prompt, N, group, compiled=False)
    drafter = misled(load_model(d).model, K, compiled=False)  # whole on every rank
    got, stats = spec_ids(model, prompt, N, drafter, group, compiled=False)
    lookup, _ = spec_ids(model, prompt, N, BatchDrafts(K), group, compiled=False)
    if group.is_root:
        np.savez(out / "draft_model.npz", plain=want, draft=got, lookup=lookup, accepted=stats.accepted,
                 expected=drafter.draft.expected)


if __name__ == "__main__":
    main()
