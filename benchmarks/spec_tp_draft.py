"""Under TP, where the draft model runs: on every rank alike (no message;
the default) or on rank 0 alone, its drafts shared by one all_sum a round
(spec.DraftModel(root_of=group)). One launch at --np N, greedy, the texts
of benchmarks/spec_decode.py; rank 0 prints one JSON line per run.

    python benchmarks/spec_tp_draft.py TARGET [--np 2] [--backend mpi] [--gen 128]
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def rank_main(target_dir: str, gen: int) -> None:
    from mlxcel_dist import distributed
    from mlxcel_dist.bench import run_bench
    from mlxcel_dist.loader import load_model
    from mlxcel_dist.spec import DraftModel
    from mlxcel_dist.tokenizer import Tokenizer
    from spec_decode import DRAFT, TEXTS, repeat_text

    group = distributed.init_from_env()
    TEXTS["repeat"] = repeat_text()
    target = load_model(target_dir, group=group).model
    draft = load_model(DRAFT).model
    tok = Tokenizer(Path(target_dir))
    V = target.args.vocab_size
    for kind in ("free", "repeat"):
        ids = tok.prompt_ids(TEXTS[kind], chat=False)
        for name, drafter in [("plain", None), ("every rank drafts", DraftModel(draft, 3)),
                              ("rank 0 drafts, shares", DraftModel(draft if group.is_root else None, 3,
                                                                  root_of=group, vocab=V))]:
            for _ in range(2):
                r = run_bench(target, len(ids), gen, group=group, ids=ids, drafter=drafter)
            if group.is_root:
                print(json.dumps({"text": kind, "config": name, "np": group.size(), "decode_tok_s": r["decode_tok_s"],
                                  "accepted": r.get("accepted"), "drafted": r.get("drafted")}), flush=True)


def main():
    import argparse

    from mlxcel_dist.launcher import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--backend", default="mpi")
    ap.add_argument("--gen", type=int, default=128)
    a = ap.parse_args()
    sys.exit(launch(["--rank", a.target, str(a.gen)], a.np, a.backend, script=__file__))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], int(sys.argv[3]))
    else:
        main()
