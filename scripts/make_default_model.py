#!/usr/bin/env python
"""Build the small embedded default model ``models/gemma3-tiny/``.

Run from the repository root:

    /work/venv/bin/python scripts/make_default_model.py [--steps N] [--max-cpu-seconds S]

Steps:
  1. read the corpus ``scripts/data/corpus.txt`` (original text written for this
     project, CC0);
  2. train a byte-level BPE tokenizer (``tokenizers``), vocab 512, special tokens
     ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<unk>``=3 (Gemma ids); the
     tokenizer prepends ``<bos>`` like Gemma's;
  3. build a ~0.85M-parameter ``Gemma3ForCausalLM`` (model_type ``gemma3_text``):
     hidden 128, 4 heads / 2 KV heads, head_dim 32, intermediate 384, 4 layers
     [sliding, sliding, sliding, full], sliding_window 32, tied embeddings, float32;
  4. train it with torch on CPU (2 threads, fixed number of steps; a guard stops
     it early if it exceeds ``--max-cpu-seconds`` of CPU time) on random
     160-token crops of the corpus;
  5. save config / safetensors / tokenizer / generation config / model card and
     print a greedy sample.

Deterministic for a given machine (fixed seeds and step count) unless the
CPU-time guard stops training early.  About 60 s wall / 150 s CPU when the
machine is idle.
"""

from __future__ import annotations

import os

# Avoid OpenMP busy-waiting, which wastes most of the CPU when the 2 cores are shared.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "scripts" / "data" / "corpus.txt"
OUT = ROOT / "models" / "gemma3-tiny"

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0, 1, 2, 3 (Gemma convention)
PAD, EOS, BOS, UNK = 0, 1, 2, 3
VOCAB = 512
SEQ = 160  # training crop length (> 4 sliding windows)
BATCH = 16
SEED = 1234
SAMPLE_PROMPT = "The sea"
LONG_PROMPT = (
    "The fishermen leave the harbor before the sun is up. Their boats are small and painted white and blue. They"
)



CHAT_TEMPLATE = "{#- The embedded model is a base model trained on plain English text, with no\n    chat turns: its template is the conversation's text, one message per line\n    (the system prompt first), so a chat prompt reads as the text it was\n    trained on. -#}\n{{ bos_token }}\n{%- for message in messages -%}\n{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}\n{%- if not loop.last %}\n{% endif -%}\n{%- endfor -%}\n{%- if add_generation_prompt and messages and messages[-1]['role'] != 'assistant' -%}{%- endif -%}\n"

def read_documents() -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    return docs


def train_tokenizer(docs: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIALS] == [PAD, EOS, BOS, UNK]
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    # prepend <bos> like Gemma's tokenizer (tokenizer_config also says add_bos_token=true)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", BOS)]
    )
    return tok


def build_stream(tok: Tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token stream  <bos> doc <eos> <bos> doc <eos> ...  and the indices of line starts."""
    ids: list[int] = []
    starts: list[int] = []
    for doc in docs:
        ids.append(BOS)
        for j, line in enumerate(doc.split("\n")):
            starts.append(len(ids))
            text = line if j == 0 else "\n" + line
            enc = tok.encode(text, add_special_tokens=False).ids
            if j > 0:  # "\n" is its own token; the line itself starts right after it
                starts[-1] += 1
            ids.extend(enc)
        ids.append(EOS)
    return np.array(ids, dtype=np.int64), np.array(starts, dtype=np.int64)


def make_model() -> Gemma3ForCausalLM:
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=32,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return Gemma3ForCausalLM(cfg)


def batch_iter(stream: np.ndarray, starts: np.ndarray, rng: np.random.Generator):
    n = len(stream)
    valid_starts = starts[starts + SEQ - 1 <= n]
    while True:
        rows = []
        for b in range(BATCH):
            if b % 2 == 0:  # begin at a line start, as a prompt would
                s = int(rng.choice(valid_starts))
            else:
                s = int(rng.integers(0, n - SEQ))
            seg = stream[s : s + SEQ - 1]
            if seg[0] == BOS:
                seg = stream[s + 1 : s + SEQ]
            rows.append(np.concatenate([[BOS], seg]))
        yield torch.from_numpy(np.stack(rows))


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, n: int = 60) -> tuple[str, int]:
    enc = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True), int(enc["input_ids"].shape[1])


def write_card(path: Path, stats: dict) -> None:
    card = f"""---
license: cc0-1.0
language: en
library_name: transformers
pipeline_tag: text-generation
tags: [gemma3, tiny, test-model]
---

# gemma3-tiny

A **toy** Gemma 3 text model (`Gemma3ForCausalLM`, `model_type: gemma3_text`) of
{stats['params']:,} parameters, bundled with mlxcel-dist as the default model for
demos and tests. It writes simple English sentences about the sea, the weather,
cities and numbers; it knows nothing else and is not useful for real tasks.

| | |
|---|---|
| hidden size | 128 |
| layers | 4 (`sliding, sliding, sliding, full`) |
| attention heads / KV heads / head dim | 4 / 2 / 32 |
| MLP intermediate size | 384 (GeGLU, `gelu_pytorch_tanh`) |
| sliding window | 32 |
| RoPE theta (full / sliding) | 1e6 / 1e4 |
| vocabulary | 512 (byte-level BPE; `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3) |
| embeddings | tied (`lm_head` = `embed_tokens`) |
| dtype | float32 |

## How it was made

`scripts/make_default_model.py` in the mlxcel-dist repository (transformers
{transformers.__version__}, torch {torch.__version__}, CPU):

1. byte-level BPE tokenizer (Hugging Face `tokenizers`) trained on the corpus
   `scripts/data/corpus.txt` ({stats['corpus_bytes']:,} bytes, {stats['corpus_tokens']:,} tokens);
   the tokenizer prepends `<bos>`;
2. model initialised with transformers' default Gemma 3 init (seed {SEED});
3. trained for {stats['steps']} steps of AdamW (batch {BATCH} x {SEQ} tokens, peak lr
   {stats['lr']}, cosine decay; about 2-3 CPU-minutes with 2 threads); final training loss
   {stats['final_loss']:.3f} (mean of the last 20 steps).

The model has memorised much of its tiny corpus. It was trained on sequences of
{SEQ} tokens, so prompts plus generations longer than that are out of distribution
(the sliding-window layers still work, the full-attention layer may degrade).
Documents end with `<eos>`, so generation can stop on its own.

Greedy sample (prompt `{SAMPLE_PROMPT}`, 60 new tokens):

> {stats['sample'].strip().replace(chr(10), chr(10) + '> ')}

## License

The training text is original, written for this project and dedicated to the
public domain under CC0 1.0; no third-party data was used. The weights and
tokenizer are derived only from that text and random initialisation and are
released under CC0 1.0 as well.
"""
    path.write_text(card, encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--max-cpu-seconds",
        type=float,
        default=360.0,
        help="guard on this process's CPU time (2 threads: 360 s ~ 3 min wall on an idle 2-core machine)",
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    random.seed(SEED)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    docs = read_documents()
    tok = train_tokenizer(docs)
    stream, starts = build_stream(tok, docs)
    print(f"corpus: {len(docs)} documents, {CORPUS.stat().st_size} bytes, {len(stream)} tokens")

    model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = 40
    rng = np.random.default_rng(SEED)
    batches = batch_iter(stream, starts, rng)
    losses: list[float] = []
    model.train()
    t0 = time.time()
    c0 = time.process_time()
    step = 0
    for step in range(1, args.steps + 1):
        if step <= warmup:
            lr = args.lr * step / warmup
        else:
            prog = (step - warmup) / max(1, args.steps - warmup)
            lr = args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * prog)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(batches)
        logits = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == 1:
            print(
                f"step {step:4d} loss {np.mean(losses[-50:]):.3f} lr {lr:.2e} "
                f"{time.time() - t0:6.1f}s wall {time.process_time() - c0:6.1f}s CPU",
                flush=True,
            )
        if time.process_time() - c0 > args.max_cpu_seconds:
            print(
                f"WARNING: stopping at step {step} of {args.steps}: CPU-time guard {args.max_cpu_seconds}s; "
                "the result differs from a full run"
            )
            break
    train_seconds = time.time() - t0
    train_cpu = time.process_time() - c0
    final_loss = float(np.mean(losses[-20:]))
    model.eval()

    # ---------------------------------------------------------------- save
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False, max_new_tokens=64
    )
    model.save_pretrained(OUT, safe_serialization=True)
    (OUT / "model.safetensors").chmod(0o644)
    # mlx-lm reads the layer kinds from sliding_window_pattern only (see convert.mlx_lm_compatible)
    from mlxcel_dist.checkpoint.convert import mlx_lm_compatible

    cfg_path = OUT / "config.json"
    cfg_path.write_text(json.dumps(mlx_lm_compatible(json.loads(cfg_path.read_text())), indent=2, sort_keys=True) + "\n")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=model.config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(OUT)
    # Normalise tokenizer_config.json to a small, loader-friendly form.
    tcfg_path = OUT / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg.pop("backend", None)  # transformers-5-only key; the default backend is `tokenizers` anyway
    tcfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model.config.max_position_embeddings,
    )
    tcfg_path.write_text(json.dumps(dict(sorted(tcfg.items())), indent=2) + "\n")
    # A base model's chat template: the conversation's text (generate and
    # serve apply a checkpoint's template by default, as mlx-lm).
    (OUT / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        if (OUT / extra).exists():
            (OUT / extra).unlink()

    # ---------------------------------------------------------------- check the saved artefacts
    reloaded = Gemma3ForCausalLM.from_pretrained(OUT, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(OUT)
    ids = tokenizer(SAMPLE_PROMPT)["input_ids"]
    assert ids[0] == BOS and ids.count(BOS) == 1, ids
    raw = Tokenizer.from_file(str(OUT / "tokenizer.json"))
    assert raw.encode(SAMPLE_PROMPT).ids == ids, (raw.encode(SAMPLE_PROMPT).ids, ids)
    assert raw.decode(ids, skip_special_tokens=True) == SAMPLE_PROMPT
    sample, _ = greedy(reloaded, tokenizer, SAMPLE_PROMPT)
    long_sample, n_prompt = greedy(reloaded, tokenizer, LONG_PROMPT)

    write_card(
        OUT / "README.md",
        dict(
            params=n_params,
            corpus_bytes=CORPUS.stat().st_size,
            corpus_tokens=len(stream),
            steps=step,
            lr=args.lr,
            train_seconds=train_seconds,
            final_loss=final_loss,
            sample=sample,
        ),
    )
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"\nfinal training loss (mean of last 20 steps): {final_loss:.4f}  [{step} steps, {train_seconds:.0f}s wall, {train_cpu:.0f}s CPU]")
    print(f"saved {OUT.relative_to(ROOT)}: {sorted(p.name for p in OUT.iterdir())}, {total / 1e6:.2f} MB")
    print(f"\ngreedy, prompt {SAMPLE_PROMPT!r}, 60 new tokens:\n{sample}\n")
    print(f"greedy, {n_prompt}-token prompt (+60 new, crosses the 32-token window):\n{long_sample}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
