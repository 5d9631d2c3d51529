"""OpenAI's harmony response format (gpt-oss) parsed out of generated text, as a pure streaming
text function.

A harmony answer is a sequence of messages, each ``<|start|>ROLE HEADER<|message|>BODY`` closed by
``<|end|>`` (the turn goes on), ``<|return|>`` (the final answer) or ``<|call|>`` (a tool call);
the first message of a turn has no ``<|start|>ROLE`` (the chat template's generation prompt wrote
``<|start|>assistant``), e.g.::

    <|channel|>analysis<|message|>...reasoning...<|end|><|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the format as OpenAI documents it for gpt-oss, and as vLLM's OpenAI server maps it to chat
completions; this is our own parser of the decoded text, special tokens kept). The header names a
channel (``<|channel|>NAME``) and may name a recipient (``to=NAME``, in the header or after the
role). Where a message's body goes:

* a recipient ``functions.NAME`` when the request has tools: a tool call ``NAME`` whose arguments
  are the body (stripped), emitted whole at its closing marker; one cut by the token budget is
  answer text;
* channel ``analysis`` (any other recipient too): reasoning;
* anything else (``final``, a ``commentary`` preamble, no channel): answer text.

Text outside any message (a model that writes no markers) is answer text as written. Headers and
markers never reach either output. A text that could still become a marker is held back until it
is decided, so the outputs do not depend on how the text was cut into pieces (a streamed answer
equals the whole one). The body of a message cut by the token budget keeps what arrived.
"""

from __future__ import annotations

import re

from dflash_jax.serve.reasoning import held_prefix
from dflash_jax.serve.tool_calls import new_call_id

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL, ENDOFTEXT = "<|return|>", "<|call|>", "<|endoftext|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT)
# what ends a message's body: its closing markers, and (defensively) a new message's opening ones
_BODY_ENDS = (END, RETURN, CALL, ENDOFTEXT, START, CHANNEL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")

_OUTSIDE, _HEADER, _BODY = range(3)
REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "call"


def is_harmony(tokenizer) -> bool:
    """Whether a tokenizer's vocabulary is harmony's (it has a ``<|return|>`` token, the test
    :func:`dflash_jax.formats.tokenizer._with_harmony_stops` uses for the stops)."""
    return tokenizer is not None and tokenizer.token_to_id(RETURN) is not None


def held_marker(text: str, markers=MARKERS) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    return max(held_prefix(text, m) for m in markers)


def message_kind(header: str, tools: bool) -> tuple[str, str | None]:
    """``(kind, tool name)`` of a message from its header (the text between ``<|start|>`` or
    ``<|channel|>`` and ``<|message|>``): :data:`TOOL_CALL` with the function's name,
    :data:`REASONING` or :data:`CONTENT` with ``None`` (module docstring)."""
    to = _RECIPIENT.search(header)
    if tools and to is not None and to.group(1).startswith("functions.") and len(to.group(1)) > len("functions."):
        return TOOL_CALL, to.group(1)[len("functions."):]
    channel = _CHANNEL.search(header)
    return (REASONING if channel is not None and channel.group(1) == "analysis" else CONTENT), None


class HarmonyParser:
    """Streaming split of harmony text into reasoning, answer text and tool calls (module docstring).

    Args:
      tools: the request has tools (``False``: a ``functions.*`` message is answer text).
    """

    def __init__(self, tools: bool = False):
        self._tools = tools
        self._state, self._buf, self._header = _OUTSIDE, "", ""
        self._kind, self._name, self._pending = CONTENT, None, ""  # _pending: a tool call's body so far
        self.calls: list[dict] = []

    def _call(self, body: str) -> dict:
        call = dict(index=len(self.calls), id=new_call_id(), type="function", function=dict(name=self._name, arguments=body.strip()))
        self.calls.append(call)
        return call

    def _outside(self, out: dict) -> bool:
        """One step outside a message; ``False`` when it needs more text."""
        i = self._buf.find("<|")
        while i >= 0 and not any(self._buf.startswith(m, i) or m.startswith(self._buf[i:]) for m in MARKERS):
            i = self._buf.find("<|", i + 1)  # "<|" that starts no marker is text
        if i < 0:
            keep = held_prefix(self._buf, "<|")
            out[CONTENT].append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        out[CONTENT].append(self._buf[:i])
        self._buf = self._buf[i:]
        marker = next((m for m in MARKERS if self._buf.startswith(m)), None)
        if marker is None:  # a partial marker at the end: wait
            return False
        self._buf = self._buf[len(marker):]
        if marker in (START, CHANNEL, CONSTRAIN):
            self._state, self._header = _HEADER, "" if marker == START else marker
        elif marker == MESSAGE:
            self._state, self._kind, self._name = _BODY, CONTENT, None
        return True

    def _body(self, out: dict) -> bool:
        """One step inside a message's body; ``False`` when it needs more text."""
        hits = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            body, self._buf = self._buf[:i], self._buf[i + (0 if marker in (START, CHANNEL) else len(marker)):]
            self._state = _OUTSIDE
            if self._kind == TOOL_CALL:
                out[TOOL_CALL].append(self._call(self._pending + body))
            else:
                out[self._kind].append(body)
            return True
        keep = held_marker(self._buf, _BODY_ENDS)
        if self._kind == TOOL_CALL:
            self._pending += self._buf[: len(self._buf) - keep]
        else:
            out[self._kind].append(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        """Adds generated text; returns ``(new reasoning, new answer text, tool calls completed by
        it)``; each call is ``{"index", "id", "type": "function", "function": {"name", "arguments"}}``
        with the arguments as the model wrote them (a JSON string for ``<|constrain|>json``)."""
        self._buf += text
        out = {REASONING: [], CONTENT: [], TOOL_CALL: []}
        while True:
            if self._state == _OUTSIDE:
                if not self._outside(out):
                    break
            elif self._state == _HEADER:
                i = self._buf.find(MESSAGE)
                if i < 0:
                    break
                self._kind, self._name = message_kind(self._header + self._buf[:i], self._tools)
                self._buf, self._state, self._pending = self._buf[i + len(MESSAGE):], _BODY, ""
            elif not self._body(out):
                break
        return "".join(out[REASONING]), "".join(out[CONTENT]), out[TOOL_CALL]

    def finish(self) -> tuple[str, str, list[dict]]:
        """Flushes the end of the text: ``(reasoning, answer text, [])``; an unclosed message's
        body goes where the message did (a tool call's to the answer text), an unfinished header
        nowhere."""
        buf, self._buf = self._buf, ""
        if self._state == _HEADER:
            return "", "", []
        if self._state == _OUTSIDE or self._kind != REASONING:
            return "", (self._pending + buf if self._state == _BODY and self._kind == TOOL_CALL else buf), []
        return buf, "", []


def parse_harmony(text: str, tools: bool = False) -> tuple[str, str, list[dict]]:
    """Whole-text form of :class:`HarmonyParser`: ``(reasoning, answer text, tool calls)``."""
    p = HarmonyParser(tools)
    r1, c1, calls = p.feed(text)
    r2, c2, _ = p.finish()
    return r1 + r2, c1 + c2, calls
