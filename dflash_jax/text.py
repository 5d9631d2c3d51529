"""Text handling around generation: prompt encoding, stop texts and streaming detokenization.

:func:`encode_prompt` turns a user message into prompt ids (chat template applied);
:func:`split_stop` sorts stop texts into single-token stop ids and texts checked on the decoded
output; :class:`TextStream` turns ids into printable text one step at a time, holding back what a
later token could still change (an incomplete UTF-8 sequence, the start of a stop text).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence
from dflash_jax.errors import DFlashError
from dflash_jax.loading import Target


def encode_prompt(
    target: Target,
    text: str,
    system: str | None = None,
    raw: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Text -> prompt ids.

    Args:
      target: a :class:`~dflash_jax.loading.Target` with a tokenizer.
      text: the user message (or the whole prompt when ``raw``).
      system: an optional system message (otherwise the template's own default, if any); an
        error with ``raw``.
      raw: encode ``text`` as is, without the chat template (special tokens in it are still parsed;
        BOS follows the tokenizer's setting).
      chat_template_kwargs: extra variables for the template (for example ``enable_thinking``).
    Returns:
      the prompt's token ids, ``list[int]``.
    Raises:
      DFlashError: not a target, or a ``text``/``system``/``chat_template_kwargs`` of the wrong
        type; the target has no tokenizer; the tokenizer has no chat template (use ``raw``);
        ``system`` together with ``raw``.
    """
    if not isinstance(target, Target):
        raise DFlashError("target", f"got {type(target).__name__}", "a Target from load_target")
    if not isinstance(text, str):
        raise DFlashError("text", f"got {type(text).__name__}", "a str (the user message; token ids go straight to generate)")
    if system is not None and not isinstance(system, str):
        raise DFlashError("system", f"got {type(system).__name__}", "a str or None")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise DFlashError("chat_template_kwargs", f"got {type(chat_template_kwargs).__name__}", "a dict of template variables or None")
    tok = target.tokenizer
    if tok is None:
        raise DFlashError(f"{target.source}: tokenizer", "missing (no tokenizer.json)", "a tokenizer, or prompt ids (--prompt-ids)")
    if raw:
        if system:
            raise DFlashError("system (--system)", "not applied with --raw (no chat template)", "the system text inside the raw prompt")
        return tok.encode(text)
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tok.encode_chat(msgs, add_generation_prompt=True, **dict(chat_template_kwargs or {}))


class TextStream:
    """Incremental detokenizer for one row: ids in, printable text out.

    Text that might still change is held back: a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD until its last byte arrives) and a tail that could be the start of a stop text. Special
    tokens are skipped unless ``skip_special`` is false (a harmony answer's markers, which the
    server's :mod:`~dflash_jax.serve.harmony` parser reads). Once a stop text appears, :attr:`stopped` is set and nothing after it is
    ever emitted. Each id is decoded once, by the tokenizer's incremental decoder
    (``Tokenizer.decode_stream``, the tokenizers library's ``DecodeStream``), and a stop text is
    looked for only where it could have appeared since the last step, so a step costs what its
    new ids cost, not the whole answer (a tokenizer without an incremental decoder decodes the
    whole answer at each step).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False
        self._decoder = tokenizer.decode_stream(skip_special) if hasattr(tokenizer, "decode_stream") else None
        self._released = ""  # what the incremental decoder released (a prefix of the whole decode)

    def text(self) -> str:
        """The full text so far (cut before a stop text)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        cut = find_stop(text, self.stop)
        return text if cut is None else text[:cut]

    def _decoded(self, new: list[int]) -> str:
        """The text of every id so far (held-back bytes excepted), after adding ``new``."""
        if self._decoder is None:
            return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        self._released += "".join(self._decoder.step(i) for i in new)
        return self._released

    def feed(self, ids: Sequence[int]) -> str:
        """Adds ids; returns the newly printable text."""
        if self.stopped:
            return ""
        new = [int(i) for i in ids]
        self.ids.extend(new)
        full = self._decoded(new)
        since = max(0, self.emitted - max((len(s) for s in self.stop), default=0))  # earlier, a stop would have been found
        cut = find_stop(full, self.stop, since)
        if cut is not None:
            self.stopped = True
            out = full[self.emitted : cut]
            self.emitted = max(self.emitted, cut)
            return out
        end = len(full)
        while end > self.emitted and full[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if full[end - k : end] == s[:k]:
                    hold = max(hold, k)
                    break
        end -= hold
        out = full[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def finish(self) -> str:
        """Everything still held back (call once at the end)."""
        text = self.text()
        out = text[self.emitted :]
        self.emitted = len(text)
        return out


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """The index in ``text`` where the earliest stop text starts (at ``start`` or later), or ``None``."""
    hits = [i for i in (text.find(s, start) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


def split_stop(tokenizer, stop: Sequence[str]) -> tuple[list[int], list[str]]:
    """Splits stop texts into single-token stop ids and texts checked on the decoded output.

    Raises:
      DFlashError: stop texts without a tokenizer, or an empty stop text.
    """
    ids, texts = [], []
    for s in stop:
        if not s:
            raise DFlashError("stop (--stop)", "empty text", "a non-empty string")
        if tokenizer is None:
            raise DFlashError("stop (--stop)", "stop texts need a tokenizer", "a target with a tokenizer")
        enc = tokenizer.encode(s, add_bos=False)
        if len(enc) == 1 and tokenizer.decode(enc) == s:
            ids.append(enc[0])
        else:
            texts.append(s)
    return ids, texts


def cut_at_stop_text(tokenizer, ids: list[int], stop: Sequence[str]) -> int | None:
    """The shortest prefix length of ``ids`` whose text contains a stop text, or ``None``."""
    if not stop or find_stop(tokenizer.decode(ids, skip_special_tokens=True), stop) is None:
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if find_stop(tokenizer.decode(ids[:mid], skip_special_tokens=True), stop) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo
