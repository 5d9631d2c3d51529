"""Log-probabilities in OpenAI's shapes: the target's log-probability of each answer token and its
best alternatives, recorded on device by the decode steps (:mod:`dflash_jax.decode.logprobs`:
``log_softmax`` of the raw target logits, before temperature, top-k and top-p, as vLLM's default
``raw_logprobs``), read back by the engine with the tokens (:class:`Entry` per token) and
formatted here: a chat choice's ``logprobs.content`` (:func:`chat_content`) or a completion
choice's ``logprobs`` (:func:`completion_logprobs`). A request that asks for them runs under a
decoding set-up that records them (``Decoding(logprobs=20)``); every other request's steps record
nothing.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dflash_jax.decode.logprobs import MAX_TOP_LOGPROBS  # noqa: F401  (the bound the schemas state)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One answer token: its id, the target's log-probability of it and the best alternatives
    ``((id, logprob), ...)``, most probable first (as many as the set-up records)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def entries(tokens: np.ndarray, lp, row: int, start: int, end: int) -> list[Entry]:
    """The :class:`Entry` of positions ``[start, end)`` of ``row``, from the host copies of the
    batch's ``tokens [B, S]`` and its :class:`~dflash_jax.decode.logprobs.TokenLogprobs` ``lp``
    (``None``: none recorded, ``[]``)."""
    if lp is None:
        return []
    ids, chosen = tokens[row, start:end], lp.chosen[row, start:end]
    top_ids, top = lp.top_ids[row, start:end], lp.top[row, start:end]
    return [Entry(int(ids[i]), _finite(chosen[i]), tuple(zip(map(int, top_ids[i]), map(_finite, top[i])))) for i in range(len(ids))]


def _finite(x) -> float:
    """JSON has no -inf: a token the target gives probability 0 (never chosen) is clipped to the
    lowest float32 log-probability."""
    x = float(x)
    return x if math.isfinite(x) else float(np.finfo(np.float32).min)


def _token(tokenizer, i: int) -> str:
    return tokenizer.decode([i]) if tokenizer is not None else str(i)


def _item(tokenizer, i: int, lp: float) -> dict:
    text = _token(tokenizer, i)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_content(tokenizer, items: list[Entry], k: int) -> list[dict]:
    """OpenAI's chat ``logprobs.content``: per token ``token``, ``logprob``, ``bytes`` and
    ``top_logprobs`` (``k`` of them)."""
    return [dict(_item(tokenizer, e.id, e.logprob), top_logprobs=[_item(tokenizer, i, lp) for i, lp in e.top[:k]]) for e in items]


def completion_logprobs(tokenizer, items: list[Entry], k: int, offset: int = 0) -> dict:
    """OpenAI's (legacy) completion ``logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one ``{token: logprob}`` per token, ``k`` entries; ``None`` when ``k`` is 0)
    and ``text_offset`` (each token's character offset in the answer, from ``offset``)."""
    tokens, offsets = [], []
    for e in items:
        offsets.append(offset)
        tokens.append(_token(tokenizer, e.id))
        offset += len(tokens[-1])
    tops = [{_token(tokenizer, i): lp for i, lp in e.top[:k]} for e in items] if k else None
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in items], "top_logprobs": tops, "text_offset": offsets}
