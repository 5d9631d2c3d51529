"""Reasoning text (``<think>...</think>``) split from the answer, as a pure streaming text function.

:class:`ReasoningSplitter` takes the generated text in pieces of any size and returns, for each
piece, the new reasoning text and the new answer text. A tag split across pieces is held back
until it is complete, so no partial ``<think>`` or ``</think>`` ever reaches either output, and
the outputs do not depend on how the text was cut into pieces (a streamed answer equals the
whole one).

Rules: a reasoning block is recognised only at the start of the answer (after optional
whitespace), or from the first character when the prompt itself ended with ``<think>`` (chat
templates that open the block for the model: Qwen3 with thinking on, Laguna's
``<assistant><think>``). The block ends at the first ``</think>``; whitespace right after it is
dropped; everything after is answer text (a later ``<think>`` included). A block that never closes
(the token budget ran out) is all reasoning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"

_START, _THINK, _AFTER, _CONTENT = range(4)


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (the part a
    streaming parser must hold back because the next piece may complete the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning block (ends with ``<think>``)."""
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningSplitter:
    """Streaming split of generated text into ``(reasoning, content)`` (module docstring).

    Args:
      in_reasoning: the prompt opened the block (:func:`prompt_opens_reasoning`): the text starts
        as reasoning and only ``</think>`` is looked for.
    """

    def __init__(self, in_reasoning: bool = False):
        self._state = _THINK if in_reasoning else _START
        self._buf = ""
        self.saw_reasoning = in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """Adds generated text; returns ``(new reasoning text, new answer text)``."""
        self._buf += text
        reasoning, content = [], []
        while True:
            if self._state == _START:
                s = self._buf.lstrip()
                if s.startswith(OPEN):
                    self._buf, self._state, self.saw_reasoning = s[len(OPEN):], _THINK, True
                    continue
                if OPEN.startswith(s):  # empty, or a partial "<think>": wait for more
                    break
                self._state = _CONTENT
            elif self._state == _THINK:
                i = self._buf.find(CLOSE)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf, self._state = self._buf[i + len(CLOSE):], _AFTER
                    continue
                keep = held_prefix(self._buf, CLOSE)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            elif self._state == _AFTER:
                s = self._buf.lstrip()
                self._buf = s
                if not s:
                    break
                self._state = _CONTENT
            else:
                content.append(self._buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flushes what was held back at the end of the text: ``(reasoning, content)``."""
        buf, self._buf = self._buf, ""
        if self._state == _THINK:
            return buf, ""
        if self._state == _AFTER:
            return "", ""
        return "", buf


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """Whole-text form of :class:`ReasoningSplitter`: ``(reasoning or None, content)``."""
    sp = ReasoningSplitter(in_reasoning)
    r1, c1 = sp.feed(text)
    r2, c2 = sp.finish()
    return (r1 + r2 if sp.saw_reasoning else None), c1 + c2
