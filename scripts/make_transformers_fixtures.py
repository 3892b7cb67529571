#!/usr/bin/env python
"""Record what transformers does when it samples and renders chat templates,
so tests/test_generate.py checks the project against it without torch
(CI has none).

Run from the repository root (needs torch and transformers: `pip install -e ".[reference]"`;
recorded with torch 2.13.0 CPU and transformers 5.24.0):

    python scripts/make_transformers_fixtures.py

It writes tests/fixtures/transformers/:

* ``sampling.json`` + ``sampling.npz``: for each case (a `SamplingParams`
  field dict, fixed input logits and context ids), transformers' own
  ``generate`` is run on a stub model whose every forward returns those
  logits (a tiny Llama whose output logits are replaced). The generation
  config is the one a user of transformers would write for the same options
  (do_sample = temp > 0, temperature, top_k, top_p, min_p,
  repetition_penalty); with ``repetition_context_size`` N the prompt is the
  last N context ids (transformers penalises the whole prompt). Recorded from
  ``output_scores``: the processed float32 scores of each step (the
  distribution a token is drawn from; greedy: what the argmax is taken of)
  and, for greedy cases, the tokens transformers chose (several steps, so the
  repetition penalty of the tokens generated so far is in it).
  npz keys per case i: ``logits_i`` float32 [V], ``context_i`` int64 [C]
  (the whole context, before any context-size cut), ``scores_i`` float32
  [steps, V] (-inf where a token was removed), ``tokens_i`` int64 [steps]
  (greedy cases; sampled cases record one step and no tokens: torch's draw
  is not ours). transformers penalises every id it is given, so a greedy case
  with a context window runs one step at a time on the last N ids of context
  + generated.
* ``chat_templates.json``: templates, conversations, and for every
  (template, conversation, add_generation_prompt) transformers'
  ``apply_chat_template`` text and token ids (tokenize=True) with the
  embedded default model's tokenizer (models/gemma3-tiny), or the message of
  the error it raised; plus ``layouts``: where transformers takes the
  template from when a checkpoint has several (chat_template.jinja vs
  tokenizer_config.json, a list of named templates).

Deterministic: rerunning gives the same bytes (fixed seeds, single-threaded
torch, zip entries with fixed timestamps, JSON in a fixed order; the chat
file keeps the messages' key order, which `tojson` prints).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from fixture_lib import FIXTURES, ROOT, write_npz

OUT = FIXTURES / "transformers"
TOKENIZER = ROOT / "models" / "gemma3-tiny"
GREEDY_STEPS = 6


# --------------------------------------------------------------------------- sampling

def _logits(seed: int, V: int = 257, scale: float = 3.0, ties: bool = False) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=V) * scale
    if ties:
        x = np.round(x * 2) / 2  # many equal logits: ties at the top-k / min-p thresholds
    return x.astype(np.float32)


def _context(seed: int, V: int, n: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, n).astype(np.int64)


# name -> (SamplingParams fields, logits kwargs, context seed)
SAMPLING_CASES = {
    # the chains of test_generate.py's numpy comparison
    "all_filters": (dict(temp=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3), dict(seed=11), 3),
    "hot_top_p": (dict(temp=1.5, top_p=0.5), dict(seed=11), 3),
    "cold_min_p": (dict(temp=0.5, min_p=0.2), dict(seed=11), 3),
    "top_k_penalty_below_1": (dict(temp=1.0, top_k=5, repetition_penalty=0.8), dict(seed=11), 3),
    "context_window": (dict(temp=2.0, top_k=100, top_p=0.95, repetition_penalty=1.1, repetition_context_size=8),
                       dict(seed=11), 3),
    # one filter at a time, temperature 1 (no division)
    "temp_1_only": (dict(temp=1.0), dict(seed=12), 4),
    "top_k_only": (dict(temp=1.0, top_k=17), dict(seed=12), 4),
    "top_p_only": (dict(temp=1.0, top_p=0.9), dict(seed=12), 4),
    "min_p_only": (dict(temp=1.0, min_p=0.1), dict(seed=12), 4),
    "cool_min_p": (dict(temp=0.8, min_p=0.01), dict(seed=12, scale=1.0), 4),
    # edges: top-k past the vocabulary, a top-p that keeps only the top token, min-p 1
    "top_k_over_vocab": (dict(temp=0.8, top_k=1000), dict(seed=13), 5),
    "top_p_tiny": (dict(temp=0.9, top_p=1e-6), dict(seed=13), 5),
    "min_p_one": (dict(temp=1.3, min_p=1.0), dict(seed=13), 5),
    # many equal logits (top-k keeps every tie at the k-th largest)
    "ties_top_k": (dict(temp=1.0, top_k=10), dict(seed=14, ties=True), 6),
    "ties_min_p": (dict(temp=1.4, min_p=0.02, repetition_penalty=1.2), dict(seed=14, ties=True, scale=1.5), 6),
    # a wider vocabulary, sharper logits
    "wide_vocab": (dict(temp=0.9, top_k=64, top_p=0.9, min_p=0.01, repetition_penalty=1.15),
                   dict(seed=15, V=4099, scale=2.0), 7),
    # greedy: only the repetition penalty, then argmax (several steps)
    "greedy": (dict(), dict(seed=16, scale=1.0), 8),
    "greedy_penalty": (dict(repetition_penalty=1.5), dict(seed=16, scale=1.0), 8),
    "greedy_penalty_below_1": (dict(repetition_penalty=0.7), dict(seed=16, scale=1.0), 8),
    "greedy_penalty_window": (dict(repetition_penalty=2.0, repetition_context_size=4), dict(seed=17, scale=0.5), 9),
}


class FixedLogits(LlamaForCausalLM):
    """A tiny Llama whose every forward returns `self.fixed` as the logits
    of every position: transformers' generate then runs its real processor
    list on known scores."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = self.fixed.to(out.logits.dtype).expand_as(out.logits).clone()
        return out


def stub_model(V: int) -> FixedLogits:
    cfg = LlamaConfig(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return FixedLogits(cfg).eval()


def generation_config(p: dict, steps: int) -> GenerationConfig:
    temp = p.get("temp", 0.0)
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=temp > 0, num_beams=1,
              repetition_penalty=float(p.get("repetition_penalty", 1.0)), output_scores=True,
              return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if temp > 0:
        kw.update(temperature=float(temp), top_k=int(p.get("top_k", 0)), top_p=float(p.get("top_p", 1.0)),
                  min_p=float(p["min_p"]) if p.get("min_p", 0) > 0 else None)
    return GenerationConfig(**kw)


def generate(model, prompt: np.ndarray, params: dict, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' generate: processed scores [steps, V] and the tokens chosen."""
    torch.manual_seed(1234)
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt)[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=generation_config(params, steps))
    scores = torch.stack([s[0] for s in out.scores]).to(torch.float32).numpy()
    return scores, out.sequences[0, len(prompt):].numpy().astype(np.int64)


def record_sampling() -> None:
    meta, arrays = [], {}
    for i, (name, (params, lkw, cseed)) in enumerate(SAMPLING_CASES.items()):
        x = _logits(**lkw)
        ctx = _context(cseed, len(x))
        n = params.get("repetition_context_size", 0)
        prompt = ctx[-n:] if n else ctx
        greedy = params.get("temp", 0.0) == 0
        steps = GREEDY_STEPS if greedy else 1
        model = stub_model(len(x))
        model.fixed = torch.tensor(x)
        if n and greedy:
            # transformers penalises every id it is given: a context window of
            # n is one step at a time on the last n ids of context + generated
            seq, rows = list(ctx), []
            for _ in range(steps):
                s, t = generate(model, np.array(seq[-n:]), params, 1)
                rows.append(s[0])
                seq.append(int(t[0]))
            scores, tokens = np.stack(rows), np.array(seq[len(ctx):], np.int64)
        else:
            scores, tokens = generate(model, prompt, params, steps)
        assert scores.shape == (steps, len(x)) and len(tokens) == steps, (name, scores.shape, tokens)
        arrays[f"logits_{i}"] = x
        arrays[f"context_{i}"] = ctx
        arrays[f"scores_{i}"] = scores
        if greedy:
            assert (tokens == scores.argmax(-1)).all(), name
            arrays[f"tokens_{i}"] = tokens
        meta.append(dict(index=i, name=name, params=params, vocab=len(x), context=len(ctx),
                         prompt_ids=len(prompt), steps=steps, greedy=greedy,
                         kept=int(np.isfinite(scores[0]).sum()),
                         tokens=tokens.tolist() if greedy else None))
    write_npz(OUT / "sampling.npz", arrays)
    (OUT / "sampling.json").write_text(json.dumps(
        dict(made_by="scripts/make_transformers_fixtures.py", transformers=transformers.__version__,
             torch=torch.__version__, cases=meta), indent=1, sort_keys=True, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- chat templates

TEMPLATES = {
    # test_generate.py's TEMPLATE: system via tojson, raise_exception, {% generation %}, trim
    "test": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set msgs = messages[1:] %}"
        "{% else %}{% set sys = none %}{% set msgs = messages %}{% endif %}\n"
        "{% for m in msgs %}\n"
        "  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}\n"
        "<|{{ m['role'] }}|>\n"
        "  {% if loop.first and sys %}{{ sys | tojson }}\n\n{% endif %}\n"
        "  {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}"
        "{% else %}{{ m['content'] | trim }}{% endif %}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Gemma's: system folded into the first user turn, strict alternation
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = \"\" %}{% set loop_messages = messages %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{% endif %}"
        "{% if (message['role'] == 'assistant') %}{% set role = \"model\" %}{% else %}{% set role = message['role'] %}{% endif %}"
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
        "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
    ),
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # the environment's corners: namespace, loop controls, tojson's options,
    # tools/documents (None), other special tokens, whitespace control
    "features": (
        "{%- set ns = namespace(n=0) -%}\n"
        "{%- for m in messages -%}\n"
        "  {%- if m['content'] == '' -%}{% continue %}{%- endif -%}\n"
        "  {%- set ns.n = ns.n + 1 -%}\n"
        "  [{{ ns.n }}|{{ m['role'] | upper }}] {{ m['content'] }}\n"
        "  {% if m['role'] == 'system' %}{{ m | tojson(indent=2, sort_keys=True) }}\n"
        "{% endif %}\n"
        "  {%- if ns.n >= 3 %}{% break %}{% endif %}\n"
        "{%- endfor %}\n"
        "{% if tools is none and documents is none %}(no tools){% endif %}\n"
        "{{ pad_token }}{{ unk_token }}{{ messages | length }} {{ messages[-1]['content'] | tojson }}"
        " {{ messages[-1] | tojson(separators=(',', ':')) }}\n"
        "{%- if add_generation_prompt %}<|gen|>{% endif %}.\n"  # a final newline after text: jinja drops it
    ),
}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Tell me about the sea."}],
    "system": [{"role": "system", "content": "Be brief — café 🌊."}, {"role": "user", "content": "  Hi  "}],
    "multi_turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "And the sky?"}],
    "assistant_last": [{"role": "user", "content": "Q?"},
                       {"role": "assistant", "content": "A \"quoted\" <b>&amp;</b>\n second line  "}],
    "odd_text": [{"role": "system", "content": ""},
                 {"role": "user", "content": "日本語\ttab \\backslash {{ not jinja }} {% raw %}"}],
    "tool_role": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}],
    "two_users": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}
# where the template comes from when a checkpoint has several
LAYOUTS = {
    # chat_template.jinja beside tokenizer_config.json's string: the file wins
    "jinja_file_and_config": {"chat_template.jinja": "llama3", "tokenizer_config": "chatml"},
    # a list of named templates: "default" is used
    "named_list": {"tokenizer_config": [["tool_use", "chatml"], ["default", "gemma"]]},
}


def checkpoint(d: Path, layout: dict) -> Path:
    shutil.copytree(TOKENIZER, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    t = layout.get("tokenizer_config")
    if isinstance(t, str):
        tc["chat_template"] = TEMPLATES[t]
    elif isinstance(t, list):
        tc["chat_template"] = [{"name": n, "template": TEMPLATES[src]} for n, src in t]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    if "chat_template.jinja" in layout:
        (d / "chat_template.jinja").write_text(TEMPLATES[layout["chat_template.jinja"]])
    return d


def render(tok, conv, gen: bool) -> dict:
    try:
        text = tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
        ids = tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, return_dict=False)
    except Exception as e:  # what transformers refuses, we must refuse
        return {"error": str(e), "error_type": type(e).__name__}
    return {"text": text, "ids": [int(i) for i in ids]}


def record_chat() -> None:
    cases, layouts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in TEMPLATES:
            tok = AutoTokenizer.from_pretrained(str(checkpoint(Path(tmp) / name, {"tokenizer_config": name})))
            for conv in CONVERSATIONS:
                for gen in (True, False):
                    cases.append({"template": name, "conversation": conv, "add_generation_prompt": gen,
                                  **render(tok, CONVERSATIONS[conv], gen)})
        for name, layout in LAYOUTS.items():
            tok = AutoTokenizer.from_pretrained(str(checkpoint(Path(tmp) / f"layout_{name}", layout)))
            layouts[name] = {"files": layout, **render(tok, CONVERSATIONS["multi_turn"], True)}
    errors = sum("error" in c for c in cases)
    assert 0 < errors < len(cases), errors
    (OUT / "chat_templates.json").write_text(json.dumps(
        dict(made_by="scripts/make_transformers_fixtures.py", transformers=transformers.__version__,
             tokenizer=str(TOKENIZER.relative_to(ROOT)), templates=TEMPLATES, conversations=CONVERSATIONS,
             cases=cases, layouts=layouts), indent=1, ensure_ascii=False) + "\n")


def main() -> int:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    record_sampling()
    record_chat()
    (OUT / "README.md").write_text(
        "# transformers generation fixtures\n\n"
        "Generated by `scripts/make_transformers_fixtures.py` (do not edit by hand; rerun the script).\n"
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU.\n\n"
        "- `sampling.json` / `sampling.npz`: transformers' `generate` on a stub model with fixed logits: the\n"
        "  processed scores per step (`output_scores`) and, greedy, the tokens it chose, per sampling case.\n"
        "- `chat_templates.json`: `apply_chat_template` text and ids (or the error) for every template x\n"
        "  conversation x add_generation_prompt, with models/gemma3-tiny's tokenizer, and which template a\n"
        "  checkpoint with several uses.\n\n"
        "tests/test_generate.py compares the project's sampler and chat rendering with these, without torch.\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(SAMPLING_CASES)} sampling cases, "
          f"{len(TEMPLATES) * len(CONVERSATIONS) * 2} chat renderings, {len(LAYOUTS)} layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
