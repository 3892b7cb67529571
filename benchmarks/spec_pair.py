"""Speculative decoding's target: a 9.8M Gemma 3 trained as gemma3-tiny
(its draft, 0.85M) was, same text and tokenizer (make_default_model.py).
python benchmarks/spec_pair.py OUT_DIR STEPS DEVICE"""
import json, math, shutil, sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_default_model as mdm  # noqa: E402


def main():
    out, steps, dev = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    tiny = ROOT / "models" / "gemma3-tiny"
    stream, starts = mdm.build_stream(Tokenizer.from_file(str(tiny / "tokenizer.json")), mdm.read_documents())
    torch.manual_seed(mdm.SEED)
    cfg = json.loads((tiny / "config.json").read_text())
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    cfg.update(hidden_size=320, intermediate_size=960, num_hidden_layers=8, num_attention_heads=4,
               num_key_value_heads=2, head_dim=80, query_pre_attn_scalar=80, layer_types=kinds * 2)
    for k in ("_sliding_window_pattern", "sliding_window_pattern", "architectures", "dtype"):
        cfg.pop(k, None)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg)).to(dev)
    print(sum(p.numel() for p in model.parameters()), "parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    batches = mdm.batch_iter(stream, starts, np.random.default_rng(mdm.SEED))
    for step in range(1, steps + 1):
        w = step / 100 if step <= 100 else 0.05 + 0.475 * (1 + math.cos(math.pi * (step - 100) / (steps - 100)))
        for g in opt.param_groups:
            g["lr"] = 2e-3 * w
        x = next(batches).to(dev)
        logits = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, mdm.VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    model.to("cpu").save_pretrained(out, max_shard_size="12MB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / f, out / f)


if __name__ == "__main__":
    main()
