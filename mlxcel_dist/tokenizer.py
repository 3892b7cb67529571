"""Text in and out: tokenizer.json through `tokenizers`, BOS/EOS from the
checkpoint's tokenizer_config.json / generation_config.json / config.json, and
a streaming detokenizer that never emits a broken UTF-8 sequence."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not valid JSON") from None
    return data if isinstance(data, dict) else {}


def _token_str(v):
    return v.get("content") if isinstance(v, dict) else v


class Tokenizer:
    def __init__(self, model_dir: Path, config: dict | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise UserError(f"{model_dir}: no tokenizer.json (text commands need one; `logits` takes token ids)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise UserError(f"{path}: cannot load tokenizer ({e})") from None
        tc = _read_json(model_dir / "tokenizer_config.json")
        gc = _read_json(model_dir / "generation_config.json")
        config = config or {}
        bos = _token_str(tc.get("bos_token"))
        self.bos_id = self._tok.token_to_id(bos) if bos else config.get("bos_token_id")
        self.add_bos = bool(tc.get("add_bos_token", self.bos_id is not None))
        eos = gc.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos_tok = _token_str(tc.get("eos_token"))
        if eos_tok and self._tok.token_to_id(eos_tok) is not None:
            eos_ids.add(self._tok.token_to_id(eos_tok))
        self.eos_ids = sorted(eos_ids)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class StreamDecoder:
    """Feeds ids, yields only text that is final (no trailing U+FFFD from a
    partial multi-byte character)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def add(self, tok_id: int) -> str:
        self.ids.append(tok_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.emitted :]
        self.emitted = len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        new = text[self.emitted :]
        self.emitted = len(text)
        return new
