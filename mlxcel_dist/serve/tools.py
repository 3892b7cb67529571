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
  objects, or (v11+ templates) `[TOOL_CALLS]name[ARGS]{...}` per call;
- `harmony` (gpt-oss): a commentary message to a function,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS`
  (serve.reasoning's splitter hands every such message on in that form);
- `deepseek_v3` (DeepSeek V3 / R1) and `deepseek_v31` (V3.1):
  `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>
  NAME` and a ```json fenced object, calls a line apart (V3, R1), or
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}` (V3.1), each up to
  `<｜tool▁call▁end｜>` (either name parses both forms);
- `glm45` (GLM-4.5 / 4.6): `<tool_call>NAME` then `<arg_key>K</arg_key>
  <arg_value>V</arg_value>` pairs, `</tool_call>`;
- `kimi_k2`: `<|tool_calls_section_begin|>` then per call
  `<|tool_call_begin|>functions.NAME:i<|tool_call_argument_begin|>{...}
  <|tool_call_end|>`;
- `minimax_m2`: `<minimax:tool_call>` blocks of `<invoke name="NAME">
  <parameter name="K">V</parameter>...</invoke>`.

The XML forms (glm45, minimax_m2) write a string value bare and any other
value as JSON: a value is a string where the function's JSON schema says
so, else JSON when it parses as JSON (vLLM's rule). Their markers are
special tokens in those vocabularies: rows of these formats are
detokenised with special tokens kept (`KEEPS_SPECIAL`).

`detect` picks the format from markers in the template; `serve
--tool-call-parser` overrides it. `StreamParser` lets text through until a
call may have begun, then holds the rest for `finish`.
"""

from __future__ import annotations

import json
import re
import uuid

FORMATS = ("hermes", "llama3_json", "mistral", "harmony", "deepseek_v3", "deepseek_v31", "glm45", "kimi_k2",
           "minimax_m2")
KEEPS_SPECIAL = ("harmony", "deepseek_v3", "deepseek_v31", "glm45", "kimi_k2", "minimax_m2")
DS_CALLS, DS_CALL, DS_SEP, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_SECTION, KIMI_CALL, KIMI_ARGS, KIMI_END = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                                "<|tool_call_argument_begin|>", "<|tool_call_end|>")
MINIMAX = "<minimax:tool_call>"
START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>",
          "harmony": "<|channel|>commentary to=", "deepseek_v3": DS_CALLS, "deepseek_v31": DS_CALLS,
          "glm45": "<tool_call>", "kimi_k2": KIMI_SECTION, "minimax_m2": MINIMAX}


def detect(template: str | None) -> str | None:
    """The tool-call format a chat template's text writes, or None."""
    if not template or "tool" not in template:
        return None
    if "<|channel|>" in template and "<|call|>" in template:  # gpt-oss's writes "to=" and "functions." apart
        return "harmony"
    if DS_CALLS in template:  # V3 / R1 fence the arguments in ```json, V3.1 does not
        return "deepseek_v3" if "```json" in template else "deepseek_v31"
    for marker, fmt in ((KIMI_SECTION, "kimi_k2"), (MINIMAX, "minimax_m2"), ("<arg_key>", "glm45")):
        if marker in template:
            return fmt
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


def _schemas(tools: list | None) -> dict:
    """function name -> its parameters' properties (the XML forms' value types)."""
    out = {}
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else {}
        params = f.get("parameters") if isinstance(f, dict) else None
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(f, dict) and isinstance(props, dict):
            out[f.get("name")] = props
    return out


def _value(raw: str, schema) -> object:
    """An XML form's argument: a string where the schema says so, else JSON if it parses."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _xml_calls(text: str, block: str, item: str, tools) -> tuple[str, list] | None:
    """Calls of an XML form: `block` matches each call block (group 1: its
    body), `item` each call in a body (groups: name, arguments part)."""
    props = _schemas(tools)
    calls, content, last = [], [], 0
    for m in re.finditer(block, text, re.S):
        found = []
        for name, body in item(m.group(1)):
            schema = props.get(name.strip(), {})
            args = {k.strip(): _value(v.strip("\n"), schema.get(k.strip())) for k, v in body}
            found.append(_call(name.strip(), args))
        if not found or any(c is None for c in found):
            return None
        content.append(text[last:m.start()])
        last = m.end()
        calls += found
    content.append(text[last:])
    return "".join(content).strip(), calls


# Formats whose calls are blocks of their own: (a block's start, its end).
BLOCKS = {"hermes": ("<tool_call>", "</tool_call>"), "glm45": ("<tool_call>", "</tool_call>"),
          "deepseek_v3": (DS_CALL, DS_END), "deepseek_v31": (DS_CALL, DS_END), "kimi_k2": (KIMI_CALL, KIMI_END)}


def parse(fmt: str, text: str, tools: list | None = None, forced: bool = False) -> tuple[str, list]:
    """(content, tool calls) of a whole answer; text that does not parse as
    calls stays content (the model's words, not an error). `tools`: the
    request's, whose schemas type the XML forms' values. A last call block
    cut by the answer's end (max_tokens) is dropped, never left as content
    beside the calls before it (OpenAI returns no call markup); with
    `forced` calls (the whole answer is calls) an answer with no whole call
    is no content either."""
    block = BLOCKS.get(fmt)
    at = text.rfind(block[0]) if block else -1
    if block and (at < 0 or block[1] in text[at:]):  # or cut inside its start marker
        at = next((len(text) - k for k in range(len(block[0]) - 1, 0, -1) if text.endswith(block[0][:k])), -1)
    if at >= 0 and (block[0] not in text[at:] or block[1] not in text[at:]):
        content, calls = _parse(fmt, text[:at], tools)
        if calls or forced:  # forced: all of it was call markup (thinking is split off before)
            return (content if calls else ""), calls
    content, calls = _parse(fmt, text, tools)
    if not calls and fmt == "llama3_json" and ";" in text:  # calls joined by ";": the cut last one dropped
        head = _parse(fmt, text[:text.rfind(";")], tools)
        if head[1] and (forced or text.lstrip().startswith(("{", "<|python_tag|>"))):
            return head
    return ("", calls) if forced and not calls else (content, calls)


def _parse(fmt: str, text: str, tools: list | None = None) -> tuple[str, list]:
    if fmt in ("glm45", "minimax_m2"):
        if fmt == "glm45":
            # a block without its closing tag (an answer cut by max_tokens) stays text: its arguments may be cut
            got = _xml_calls(text, r"<tool_call>(.*?)</tool_call>", lambda b: [(
                b.split("<arg_key>", 1)[0], re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>",
                                                       b, re.S))], tools)
        else:
            # one block holds every call: an answer cut inside it keeps its whole invokes, drops a cut one
            got = _xml_calls(text, re.escape(MINIMAX) + r"(.*?)(?:</minimax:tool_call>|$)", lambda b: [
                (n, re.findall(r'<parameter name="([^"]*)">(.*?)</parameter>', body, re.S))
                for n, body in re.findall(r'<invoke name="([^"]*)">(.*?)</invoke>', b, re.S)], tools)
        return (text, []) if not got or not got[1] else got
    if fmt == "harmony":
        calls, content, last = [], [], 0
        for m in re.finditer(r"(<\|start\|>[^<]*)?(<\|channel\|>[^<]*(?:<\|constrain\|>[^<]*)?)"
                             r"<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)", text, re.S):
            to = re.search(r"to=(?:functions\.)?([^\s<]+)", (m.group(1) or "") + m.group(2))
            if to is None:
                continue
            try:
                call = _call(to.group(1), json.loads(m.group(3)))
            except ValueError:
                return text, []
            content.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        content.append(text[last:])
        return ("".join(content).strip() if calls else text), calls
    if fmt in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
        section, begin, sep, end = ((DS_CALLS, DS_CALL, DS_SEP, DS_END) if fmt != "kimi_k2"
                                    else (KIMI_SECTION, KIMI_CALL, KIMI_ARGS, KIMI_END))
        at = text.find(section)
        if at < 0:
            return text, []
        calls = []
        for part in text[at + len(section):].split(begin)[1:]:
            head, _, args = part.split(end, 1)[0].partition(sep)
            head = head.strip()
            if fmt == "kimi_k2":  # functions.NAME:index
                head = head.split(":", 1)[0].removeprefix("functions.")
            elif head == "function":  # V3 / R1: the name on the separator's line, the arguments fenced
                name, _, args = args.partition("\n")
                head, args = name.strip(), re.sub(r"^\s*```(?:json)?|```\s*$", "", args.strip())
            try:
                calls.append(_call(head, json.loads(args)))
            except ValueError:
                return text, []
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].strip(), calls
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

    def __init__(self, fmt: str, tools: list | None = None, forced: bool = False):
        self.fmt, self.tools, self.forced = fmt, tools, forced
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
        start = START[self.fmt]
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
        content, calls = parse(self.fmt, self.held, self.tools, self.forced)
        self.held = ""
        return content, calls


# A template that writes no tool format (or no template): forced calls
# (tool_choice required / named) still work, as vLLM forces them for any
# model. The tools go into the prompt as a system block in Hermes' words
# (Qwen's and NousResearch's templates), earlier calls and results as
# Hermes' blocks, and the grammar writes the call in that format.
FALLBACK = "hermes"
FALLBACK_PROMPT = ("# Tools\n\nYou may call one or more of these functions:\n<tools>\n{tools}\n</tools>\n\n"
                   "Write each call as <tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                   "<args-json-object>}}\n</tool_call>")


def fallback_messages(messages: list, tools: list) -> list:
    """`messages` (as the chat template takes them) with the tools described
    in the system message (the first one, or a new one) and earlier calls /
    tool results written as Hermes' blocks, for a template that renders
    neither."""
    block = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            m["content"] = (m.get("content") or "") + "".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>" for c in calls)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": block + "\n\n" + (out[0].get("content") or "")}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
