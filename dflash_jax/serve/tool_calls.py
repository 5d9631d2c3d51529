"""Tool calls parsed out of generated text, as a pure streaming text function.

A call is a ``<tool_call>...</tool_call>`` block in one of two layouts, told apart by its body:

* Hermes / Qwen (JSON): ``<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>``;
* Laguna ``poolside_v1`` (GLM-4.7 style, docs/specs/laguna.md section 5):
  ``<tool_call>f\\n<arg_key>x</arg_key><arg_value>1</arg_value>\\n...</tool_call>``; each value is
  converted by the JSON-schema type the request's tool declares for that argument (``string``
  values are kept exactly, whitespace included; ``integer``, ``number``, ``boolean``, ``object``,
  ``array`` and ``null`` are read as JSON; an argument without a declared type is read as JSON
  when it parses and kept as a string otherwise).

:class:`ToolCallParser` takes the answer text in pieces of any size and returns the new answer
text and the calls completed so far. Text that could still become ``<tool_call>`` is held back,
a call is emitted whole once its ``</tool_call>`` arrives, and whitespace next to a call is not
answer text, so a streamed answer equals the whole one. A block that does not parse (bad JSON,
no name) stays in the answer text as written.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping, Sequence

from dflash_jax.serve.reasoning import held_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id (``call_`` and 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict]:
    """``{function name: {argument: JSON-schema type}}`` of OpenAI ``tools``."""
    out: dict[str, dict] = {}
    for t in tools or ():
        fn = t.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[str(fn.get("name"))] = {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, Mapping)}
    return out


def _convert(value: str, kind) -> Any:
    """A ``poolside_v1`` argument value read by its JSON-schema type (module docstring)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds:
        return value
    try:
        return json.loads(value.strip())
    except ValueError:
        return value


def _parse_json_call(body: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already a JSON string
        try:
            json.loads(args)
        except ValueError:
            return None
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _parse_poolside_call(body: str, schemas: Mapping[str, dict]) -> tuple[str, str] | None:
    name, rest = body.split(KEY_OPEN, 1) if KEY_OPEN in body else (body, "")
    name = name.strip()
    if not name or any(c.isspace() or c in "<>{}" for c in name):
        return None
    types = schemas.get(name, {})
    args: dict[str, Any] = {}
    rest = KEY_OPEN + rest if rest else ""
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(KEY_OPEN) or KEY_CLOSE not in rest:
            return None
        key, rest = rest[len(KEY_OPEN):].split(KEY_CLOSE, 1)
        rest = rest.lstrip()
        if not rest.startswith(VALUE_OPEN) or VALUE_CLOSE not in rest:
            return None
        value, rest = rest[len(VALUE_OPEN):].split(VALUE_CLOSE, 1)
        args[key.strip()] = _convert(value, types.get(key.strip()))
    return name, json.dumps(args, ensure_ascii=False)


def parse_call(body: str, schemas: Mapping[str, dict]) -> tuple[str, str] | None:
    """``(name, arguments as a JSON string)`` of one block's body in either layout, or ``None``."""
    if body.strip().startswith("{"):
        return _parse_json_call(body.strip())
    return _parse_poolside_call(body, schemas)


class ToolCallParser:
    """Streaming extraction of tool calls from the answer text (module docstring).

    Args:
      tools: the request's OpenAI ``tools`` (their parameter types convert ``poolside_v1`` values).
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None):
        self._schemas = tool_schemas(tools)
        self._buf = ""
        self._in_call = False
        self.calls: list[dict] = []

    def _call(self, body: str) -> dict | None:
        parsed = parse_call(body, self._schemas)
        if parsed is None:
            return None
        call = dict(index=len(self.calls), id=new_call_id(), type="function", function=dict(name=parsed[0], arguments=parsed[1]))
        self.calls.append(call)
        return call

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Adds answer text; returns ``(new answer text, calls completed by it)``; each call is
        ``{"index", "id", "type": "function", "function": {"name", "arguments"}}``."""
        self._buf += text
        content, calls = [], []
        while True:
            if self._in_call:
                i = self._buf.find(CLOSE)
                if i < 0:
                    break
                body, self._buf, self._in_call = self._buf[:i], self._buf[i + len(CLOSE):], False
                call = self._call(body)
                if call is None:  # not a call after all: the text stays
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                continue
            i = self._buf.find(OPEN)
            if i >= 0:
                before = self._buf[:i]
                if before.strip():
                    content.append(before.rstrip())
                self._buf, self._in_call = self._buf[i + len(OPEN):], True
                continue
            keep = held_prefix(self._buf, OPEN)
            head = self._buf[: len(self._buf) - keep]
            stripped = head.rstrip()  # whitespace is held until text (not a call) follows it
            if stripped:
                content.append(stripped)
            self._buf = head[len(stripped):] + self._buf[len(self._buf) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> str:
        """Flushes the end of the text: an unterminated block comes back as text; whitespace
        held at the end is answer text only when there was no call."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            return OPEN + buf
        return "" if self.calls else buf
