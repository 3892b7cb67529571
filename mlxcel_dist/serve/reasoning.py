"""Reasoning text: which form a checkpoint's chat template thinks in, and the
model's answer split into its thinking (OpenAI-compatible servers'
`reasoning_content`, mlx-lm's `reasoning`) and its content (rank 0 only).

Forms (vLLM's parser names):

- `qwen3` / `deepseek_r1`: the thinking between `<think>` and `</think>`
  (Qwen3, QwQ, DeepSeek-R1 and its distills). A template that opens the
  block itself (DeepSeek-R1's, Qwen3-Thinking's: the prompt ends inside
  `<think>`) makes the answer start in the thinking; one that closes an empty
  block (Qwen3 with `enable_thinking: false`) starts it in the content. Only
  one block, and only before any content: a later `<think>` is text.
- `gpt_oss`: OpenAI's harmony messages (`<|channel|>analysis<|message|>
  ...<|end|>`, then `<|start|>assistant<|channel|>final<|message|>...`): the
  analysis channel is the thinking, the final channel the content; a
  commentary message to a function (a tool call) is handed on to the
  content in one form, `<|channel|>commentary to=NAME<|message|>ARGS<|call|>`,
  which serve.tools' `harmony` format reads. Its markers are special
  tokens: rows of this form are detokenised with them kept
  (`KEEPS_SPECIAL`).

`detect` picks the form from the template; `serve --reasoning-parser`
overrides it. `Splitter.feed(text)` returns (thinking, content) text that
is final, holding back only what may be the start of a marker;
`split(text)` of a whole answer is the same splitter fed at once.
"""

from __future__ import annotations

import re

FORMATS = ("qwen3", "deepseek_r1", "gpt_oss")
KEEPS_SPECIAL = ("gpt_oss",)  # forms whose markers are special tokens the detokeniser must keep
OPEN, CLOSE = "<think>", "</think>"
H_MESSAGE, H_END, H_START, H_CHANNEL = "<|message|>", "<|end|>", "<|start|>", "<|channel|>"
_H_ENDS = (H_END, "<|call|>", "<|return|>")


def detect(template: str | None) -> str | None:
    """The reasoning form a chat template's text thinks in, or None."""
    if not template:
        return None
    if H_CHANNEL in template and "analysis" in template:
        return "gpt_oss"
    if OPEN in template and CLOSE in template:
        return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"
    return None


def starts_thinking(fmt: str, prompt_text: str) -> bool:
    """Whether the answer to this rendered prompt begins inside the thinking
    (the template opened a `<think>` block it did not close)."""
    if fmt == "gpt_oss":
        return False
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def _held(buf: str, markers) -> int:
    """How many characters at the end of `buf` may begin one of `markers`."""
    return max((k for m in markers for k in range(min(len(m) - 1, len(buf)), 0, -1) if m.startswith(buf[-k:])),
               default=0)


class Splitter:
    """One answer's text, fed as it comes, split into (thinking, content)."""

    def __init__(self, fmt: str, thinking: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"unknown reasoning format {fmt!r}")
        self.fmt = fmt
        self.buf = ""
        # think tags: "think" (inside the block) / "before" (no content yet) / "content"
        # harmony: "header" (before a message's <|message|>) / "analysis" / "final" / "call"
        self.state = ("think" if thinking else "before") if fmt != "gpt_oss" else "header"
        self.lead = True  # the current part's leading whitespace is still being dropped

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _emit(self, out: list, kind: int, text: str) -> None:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        out[kind] += text

    def _run(self, final: bool) -> tuple[str, str]:
        out = ["", ""]
        step = self._harmony if self.fmt == "gpt_oss" else self._think
        while self.buf and step(out, final):
            pass
        return out[0], out[1]

    def _think(self, out: list, final: bool) -> bool:
        """One move over the buffer; False when it waits for more text."""
        buf = self.buf
        if self.state == "content":
            self._emit(out, 1, buf)
            self.buf = ""
            return False
        if self.state == "before":
            lead = buf.lstrip()
            if OPEN.startswith(lead) and not final and len(lead) < len(OPEN):
                return False  # space, or the start of <think>: wait
            if lead.startswith(OPEN):
                self.state, self.lead, self.buf = "think", True, lead[len(OPEN):]
                return True
            self.state, self.lead = "content", False  # no thinking: the content as written
            self._emit(out, 1, buf)
            self.buf = ""
            return False
        at = buf.find(CLOSE)  # inside the thinking (its trailing space held: the block's end drops it)
        if at >= 0:
            self._emit(out, 0, buf[:at].rstrip())
            self.state, self.lead, self.buf = "content", True, ""
            self._emit(out, 1, buf[at + len(CLOSE):])
            return False
        keep = 0 if final else _held(buf, (CLOSE,))
        keep += 0 if final else len(buf) - keep - len(buf[: len(buf) - keep].rstrip())  # and the space before it
        self._emit(out, 0, buf[: len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _harmony(self, out: list, final: bool) -> bool:
        buf = self.buf
        if self.state == "header":
            at = buf.find(H_MESSAGE)
            if at < 0:
                if final:  # no harmony message after all: the model's words
                    self._emit(out, 1, buf)
                    self.buf = ""
                return False
            header, self.buf = buf[:at], buf[at + len(H_MESSAGE):]
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            channel = channel.group(1) if channel else "final"
            to = re.search(r"to=([^\s<]+)", header)
            if to is not None:
                self.state = "call"
                out[1] += f"{H_CHANNEL}commentary to={to.group(1)}{H_MESSAGE}"
            else:
                self.state = "analysis" if channel == "analysis" else "final"
                self.lead = True
            return True
        ends = [(buf.find(m), m) for m in _H_ENDS if m in buf]
        kind = 0 if self.state == "analysis" else 1
        if ends:
            at, marker = min(ends)
            body, self.buf = buf[:at], buf[at + len(marker):]
            if self.state == "call":
                out[1] += body + "<|call|>"
            else:
                self._emit(out, kind, body)
            self.state = "header"
            if self.buf.startswith(H_START):
                self.buf = self.buf[len(H_START):]
            return True
        keep = 0 if final else _held(buf, _H_ENDS)
        body, self.buf = buf[: len(buf) - keep], buf[len(buf) - keep:]
        if self.state == "call":
            out[1] += body
        else:
            self._emit(out, kind, body)
        return False


def split(fmt: str, text: str, thinking: bool = False) -> tuple[str, str]:
    """(thinking, content) of a whole answer."""
    s = Splitter(fmt, thinking)
    a, b = s.feed(text)
    c, d = s.finish()
    return a + c, b + d


SWITCHES = ("enable_thinking", "reasoning_effort", "thinking")  # the thinking switches templates read


def template_vars(template: str | None) -> frozenset:
    """The thinking switches a chat template's text reads."""
    return frozenset(v for v in SWITCHES if template and re.search(rf"\b{v}\b", template))
