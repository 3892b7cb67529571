"""Tool calls: which format a checkpoint's chat template writes them in, and
the model's output parsed into OpenAI's `tool_calls` (rank 0 only: the ranks
generate ids, this reads their text).

Formats (vLLM's parser names):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call (Hermes, Qwen 2.5 / 3, and templates that copied them);
- `llama3_json`: the whole answer one JSON object `{"name": ..., "parameters"
  (or "arguments"): {...}}`, several joined by `;`, optionally after
  `<|python_tag|>` (Llama 3.1 - 3.3);
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`
  objects, or (v11+ templates) `[TOOL_CALLS]name[ARGS]{...}` per call.

`detect` picks the format from markers in the template; `serve
--tool-call-parser` overrides it. `StreamParser` lets text through until a
call may have begun, then holds the rest for `finish`.
"""

from __future__ import annotations

import json
import re
import uuid

FORMATS = ("hermes", "llama3_json", "mistral")
_START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


def detect(template: str | None) -> str | None:
    """The tool-call format a chat template's text writes, or None."""
    if not template or "tool" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return None


def _call(name, arguments) -> dict | None:
    if not isinstance(name, str) or not name:
        return None
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {},
                                                                   ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def _objects(text: str) -> list:
    """The JSON values in `text` one after another (separators ; , and space)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            break
        value, i = dec.raw_decode(text, i)
        out.append(value)
    return out


def parse(fmt: str, text: str) -> tuple[str, list]:
    """(content, tool calls) of a whole answer; text that does not parse as
    calls stays content (the model's words, not an error)."""
    if fmt == "hermes":
        calls, content = [], []
        last = 0
        for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S):
            try:
                obj = json.loads(m.group(1).strip())
                call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters")))
            except (ValueError, AttributeError):
                call = None
            if call is None:
                continue
            content.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        content.append(text[last:])
        return ("".join(content).strip() if calls else text), calls
    if fmt == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        body = text[at + len("[TOOL_CALLS]"):]
        calls = []
        if "[ARGS]" in body:  # name[ARGS]{...} per call
            for part in body.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                try:
                    calls.append(_call(name.strip(), json.loads(args)))
                except ValueError:
                    return text, []
        else:
            try:
                items = _objects(body)
                items = items[0] if len(items) == 1 and isinstance(items[0], list) else items
                calls = [_call(o.get("name"), o.get("arguments", o.get("parameters"))) for o in items]
            except (ValueError, AttributeError):
                return text, []
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].strip(), calls
    if fmt == "llama3_json":
        body = text.strip()
        body = body[len("<|python_tag|>"):].strip() if body.startswith("<|python_tag|>") else body
        if not body.startswith("{"):
            return text, []
        try:
            calls = [_call(o.get("name"), o.get("parameters", o.get("arguments"))) for o in _objects(body)]
        except (ValueError, AttributeError):
            return text, []
        if not calls or any(c is None for c in calls):
            return text, []
        return "", calls
    raise ValueError(f"unknown tool-call format {fmt!r}")


class StreamParser:
    """`feed(text)` returns the text that is surely content; from the first
    possible start of a call on, text is held; `finish()` returns (the held
    content, the calls)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.sent = ""  # content already let through
        self.held = ""
        self.holding = False

    def feed(self, text: str) -> str:
        if self.holding:
            self.held += text
            return ""
        buf = self.held + text
        if self.fmt == "llama3_json" and not (self.sent + buf).strip():
            self.held = buf  # only space so far: the answer may still open with a call
            return ""
        if self.fmt == "llama3_json" and not self.sent.strip() and buf.lstrip()[:1] in ("{", "<"):
            self.holding, self.held = True, buf
            return ""
        start = _START[self.fmt]
        at = buf.find(start)
        if at >= 0:
            self.holding, self.held = True, buf[at:]
            out = buf[:at]
        else:  # keep back a tail that may be the start of the marker
            keep = next((k for k in range(min(len(start) - 1, len(buf)), 0, -1) if start.startswith(buf[-k:])), 0)
            out, self.held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list]:
        """(content still to send, calls): the held text parsed as calls, or
        let through as content when it is none."""
        if not self.holding:
            out, self.held = self.held, ""
            return out, []
        content, calls = parse(self.fmt, self.held)
        self.held = ""
        return content, calls
