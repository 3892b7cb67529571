"""Text in and out: tokenizer.json through `tokenizers`; BOS/EOS from the
checkpoint's tokenizer_config.json / generation_config.json / config.json;
chat templates rendered as transformers renders them; a streaming
detokenizer that never emits a broken UTF-8 sequence; stop strings that are
never printed, not even in part."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to
# the template (its special_tokens_map) besides the messages.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not valid JSON") from None
    return data if isinstance(data, dict) else {}


def _token_str(v):
    return v.get("content") if isinstance(v, dict) else v


def _ids(v) -> list[int]:
    if v is None:
        return []
    vs = v if isinstance(v, (list, tuple)) else [v]
    return [int(x) for x in vs if isinstance(x, int) and not isinstance(x, bool)]


class Tokenizer:
    def __init__(self, model_dir: Path, config: dict | None = None, chat_template: str | None = None,
                 extra_eos=()):
        """`chat_template`: jinja text used instead of the checkpoint's (--chat-template);
        `extra_eos`: more tokens that end a generation (--extra-eos-token, `add_eos_token`)."""
        from tokenizers import Tokenizer as HFTokenizer

        self.model_dir = Path(model_dir)
        self.template_override = chat_template
        path = self.model_dir / "tokenizer.json"
        if not path.exists():
            raise UserError(f"{model_dir}: no tokenizer.json (text commands need one; `logits` takes token ids)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise UserError(f"{path}: cannot load tokenizer ({e})") from None
        self.config = tc = _read_json(self.model_dir / "tokenizer_config.json")
        gc = _read_json(self.model_dir / "generation_config.json")
        if config is None:
            config = _read_json(self.model_dir / "config.json")
        bos = _token_str(tc.get("bos_token"))
        self.bos_id = self._tok.token_to_id(bos) if bos else config.get("bos_token_id")
        # tokenizer.json's post-processor adds BOS where the checkpoint wants it
        # (what transformers 5 relies on); an explicit add_bos_token adds it
        # when the post-processor does not (transformers 4's slow-tokenizer path).
        self.add_bos = bool(tc.get("add_bos_token", False))
        # EOS: the union of every source (generation_config.json is what
        # transformers' generate uses; chat checkpoints often list their
        # end-of-turn token in only one of them).
        eos_ids = set(_ids(gc.get("eos_token_id")))
        eos_ids |= set(_ids(config.get("eos_token_id")))
        eos_ids |= set(_ids((config.get("text_config") or {}).get("eos_token_id")))
        eos_tok = _token_str(tc.get("eos_token"))
        if eos_tok and self._tok.token_to_id(eos_tok) is not None:
            eos_ids.add(self._tok.token_to_id(eos_tok))
        self.eos_ids = sorted(eos_ids)
        self.vocab_size = self._tok.get_vocab_size()
        for t in extra_eos:
            self.add_eos_token(t)
        # A tokenizer from another model: ids past the embedding table would
        # fail mid-run (or index garbage); refuse up front. Fewer tokens than
        # the vocabulary is normal (padded embedding tables).
        model_vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if model_vocab and self.vocab_size > int(model_vocab):
            raise UserError(
                f"{path}: the tokenizer has {self.vocab_size} tokens but the model's vocabulary is "
                f"{model_vocab}: tokenizer and checkpoint do not match"
            )

    def add_eos_token(self, token: str) -> None:
        """One more EOS, as mlx-lm's `--extra-eos-token`: a token of the
        vocabulary (its text, e.g. "<end_of_turn>") or an id."""
        try:
            tid = int(token)
        except ValueError:
            tid = self._tok.token_to_id(token)
        if tid is None or not 0 <= tid < self.vocab_size:
            raise UserError(f"--extra-eos-token {token!r} is not a token of this tokenizer")
        self.eos_ids = sorted(set(self.eos_ids) | {tid})

    # -- text <-> ids --------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos and self.bos_id is not None
                and (not ids or ids[0] != self.bos_id)):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, keep_special: bool = False) -> str:
        """`keep_special`: special tokens stay in the text (harmony's channel markers)."""
        return self._tok.decode(list(ids), skip_special_tokens=not keep_special)

    # -- chat ----------------------------------------------------------------
    def chat_template(self) -> tuple[str, str]:
        """(template source, where it came from). As transformers: a
        chat_template.jinja next to the tokenizer wins over tokenizer_config.json's
        `chat_template` (a string, or a list of named templates: "default")."""
        if self.template_override is not None:
            return self.template_override, "--chat-template"
        f = self.model_dir / CHAT_TEMPLATE_FILE
        if f.exists():
            try:
                return f.read_text(encoding="utf-8"), str(f)
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"{f}: cannot read chat template ({e})") from None
        t = self.config.get("chat_template")
        where = str(self.model_dir / "tokenizer_config.json")
        if isinstance(t, list):
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            if "default" not in named:
                raise UserError(f"{where}: chat_template has no template named 'default' "
                                f"(has: {', '.join(map(str, named))})")
            t = named["default"]
        if isinstance(t, str) and t:
            return t, where
        raise UserError(
            f"{self.model_dir}: this checkpoint has no chat template (no {CHAT_TEMPLATE_FILE} and no "
            "chat_template in tokenizer_config.json); give one with --chat-template, or drop --chat to use the "
            "prompt as plain text"
        )

    def has_chat_template(self) -> bool:
        if self.template_override is not None or (self.model_dir / CHAT_TEMPLATE_FILE).exists():
            return True
        t = self.config.get("chat_template")
        return bool(t) and (isinstance(t, str) or isinstance(t, list))

    def use_chat(self, chat: bool | None) -> bool:
        """Whether a prompt goes through the chat template: as asked (--chat /
        --ignore-chat-template), else when there is one (mlx-lm's default)."""
        return self.has_chat_template() if chat is None else chat

    def special_tokens_map(self) -> dict[str, str]:
        out = {}
        for name in SPECIAL_TOKEN_NAMES:
            v = _token_str(self.config.get(name))
            if v is not None:
                out[name] = str(v)
        return out

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    **template_kwargs) -> str:
        """transformers' apply_chat_template(messages, tools=..., tokenize=False,
        add_generation_prompt=..., **template_kwargs) (e.g. enable_thinking)."""
        source, where = self.chat_template()
        return render_chat_template(source, messages, add_generation_prompt=add_generation_prompt,
                                    where=where, tools=tools, **{**self.special_tokens_map(), **template_kwargs})

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                 **template_kwargs) -> list[int]:
        """Ids of the rendered chat; like transformers, no special tokens are
        added (the template writes its own BOS)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **template_kwargs),
                           add_special_tokens=False)

    def prompt_ids(self, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
        """The generation prompt: plain text (BOS added as the tokenizer says),
        or with `chat` one user turn (after an optional system turn) rendered
        through the chat template with the generation prompt. `chat` None:
        the template when the checkpoint has one (`use_chat`)."""
        chat = self.use_chat(chat)
        if system is not None and not chat:
            raise UserError("--system-prompt is a chat-template turn, but the prompt is used as plain text "
                            "(the checkpoint has no chat template, or --ignore-chat-template): give "
                            "--chat-template, or drop --system-prompt")
        if chat:
            messages = ([{"role": "system", "content": system}] if system is not None else [])
            messages.append({"role": "user", "content": prompt})
            ids = self.chat_ids(messages)
        else:
            ids = self.encode(prompt)
        if not ids:
            raise UserError("the prompt is empty and the tokenizer adds no BOS token; give a --prompt")
        return ids


def _jinja_env():
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - a declared dependency
        raise UserError("--chat needs jinja2 (pip install 'jinja2>=3.1')") from None
    from datetime import datetime

    class GenerationTag(Extension):
        # transformers' {% generation %} ... {% endgeneration %} (it tracks
        # assistant spans; rendering is just the body).
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2


def render_chat_template(source: str, messages: list[dict], add_generation_prompt: bool = True,
                         where: str = "chat template", tools: list | None = None, **special_tokens) -> str:
    """Render a chat template with transformers' jinja environment (sandboxed,
    trim_blocks, lstrip_blocks, loopcontrols, its tojson, raise_exception,
    strftime_now) and variables (messages, tools=None, documents=None,
    add_generation_prompt, bos_token/eos_token/...)."""
    env, jinja2 = _jinja_env()
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{where}: chat template syntax error at line {e.lineno}: {e.message}") from None
    try:
        return template.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.TemplateError as e:
        raise UserError(f"{where}: the chat template refused this conversation: {e}") from None
    except Exception as e:  # a template bug (e.g. bad indexing) surfaces as a Python error
        raise UserError(f"{where}: the chat template failed: {type(e).__name__}: {e}") from None


class StreamDecoder:
    """Incremental detokenizer: `add(id)` returns only text that is final.

    It decodes a short window, never the whole output: `ids[prefix:read]` was
    already emitted (kept as left context so that decoders which treat the
    first token of a decode specially, e.g. SentencePiece's leading space,
    give the right text), `ids[read:]` is pending. Text is emitted once the
    window decodes to more than its prefix and does not end in U+FFFD (an
    incomplete multi-byte character); then the window slides forward. Each
    token is decoded a bounded number of times, so streaming n tokens is O(n).
    `context` (e.g. the prompt's last ids) is left context only, never emitted.
    """

    def __init__(self, tokenizer: Tokenizer, context=(), keep_special: bool = False):
        self.tok = tokenizer
        self.keep_special = keep_special
        self.ids: list[int] = list(context)
        self.prefix = 0
        self.read = len(self.ids)
        self._prefix_text: str | None = None

    def _delta(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if not final and (len(text) <= len(self._prefix_text) or text.endswith("\ufffd")):
            return ""
        new = text[len(self._prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self._prefix_text = None
        return new

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, keep_special=True) if self.keep_special else self.tok.decode(ids)

    def add(self, tok_id: int) -> str:
        self.ids.append(int(tok_id))
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still pending (at the end: an incomplete character
        becomes U+FFFD, as a full decode would show it)."""
        if self.read == len(self.ids):
            return ""
        return self._delta(final=True)


class StopStrings:
    """Cuts streamed text at the first occurrence of any stop string.

    `feed(text)` returns the text that is safe to print: everything up to a
    match (then `stopped` is set and the match is dropped), minus the longest
    tail that could still grow into a stop string, which is held back until
    the next feed decides it. So no part of a stop string is ever printed,
    even when it arrives split across tokens. `flush()` releases the held-back
    tail at the end of generation."""

    def __init__(self, stops=()):
        self.stops = [s for s in stops]
        if any(s == "" for s in self.stops):
            raise UserError("--stop must not be empty")
        self.pending = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        self.pending += text
        hit, at = None, len(self.pending)
        for s in self.stops:
            i = self.pending.find(s)
            if 0 <= i < at:
                hit, at = s, i
        if hit is not None:
            out = self.pending[:at]
            self.pending = ""
            self.stopped = hit
            return out
        hold = 0
        for k in range(min(len(self.pending), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                hold = k
                break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped is not None else self.pending), ""
        return out


class RowText:
    """One sequence's text as its ids arrive, and where it ends: the rule
    `generate` (generation.generate_text) and serve's scheduler both apply.

    `add(id)` returns the text now final and sets `reason` when the id ends
    the sequence: "eos" (an id of `eos_ids`: not decoded, not counted),
    "stop" (the text reached a stop string: it and anything after are cut)
    or "length" (`max_tokens` ids counted); at "eos" and "length" the
    decoder's held-back tail comes with that text. Text is whole UTF-8 and
    never a part of a stop string. `context`: the prompt's last ids, left
    context of the detokenizer only."""

    def __init__(self, tokenizer: Tokenizer, stop=(), eos_ids=(), max_tokens: int | None = None, context=(),
                 keep_special: bool = False):
        self.decoder = StreamDecoder(tokenizer, context=context, keep_special=keep_special)
        self.stopper = StopStrings(stop)
        self.eos = set(int(e) for e in eos_ids)
        self.max_tokens = max_tokens
        self.generated = 0
        self.reason: str | None = None

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the sequence (None: another reason, or not ended)."""
        return self.stopper.stopped

    def add(self, tok: int) -> str:
        assert self.reason is None, "the sequence has ended"
        if tok in self.eos:
            self.reason = "eos"
            return self.close()
        self.generated += 1
        text = self.stopper.feed(self.decoder.add(tok))
        if self.stopper.stopped is not None:
            self.reason = "stop"
        elif self.max_tokens is not None and self.generated >= self.max_tokens:
            self.reason = "length"
            text += self.close()
        return text

    def close(self) -> str:
        """The held-back tail (none after a stop string): the sequence ends without a stop."""
        if self.stopper.stopped is not None:
            return ""
        return self.stopper.feed(self.decoder.flush()) + self.stopper.flush()
