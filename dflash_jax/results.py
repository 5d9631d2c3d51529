"""Reading a finished decode state back into a :class:`GenerationResult` (ids, texts, statistics)."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from dflash_jax.distributed import fetch
from dflash_jax.state import FINISH_REASONS
from dflash_jax.text import cut_at_stop_text, find_stop


@dataclasses.dataclass
class GenerationResult:
    """What :func:`dflash_jax.generate` returns.

    Attributes:
      prompt_ids: the prompts, ``list[list[int]]``.
      output_ids: generated ids per row (a stop or EOS token that ended the row included).
      finish_reason: per row ``"stop"`` (EOS, stop id or stop text), ``"length"``
        (``max_new_tokens``) or ``"capacity"`` (``max_len`` reached).
      top2_logit_gaps: per row, per output token, the gap between the two largest target logits at
        the step that chose it.
      texts: per row decoded text (special tokens skipped, cut before a stop text), or ``None``
        without a tokenizer.
      stats: ``new_tokens`` (all rows), ``prompt_tokens``, ``compile_time_s``,
        ``prefill_time_s`` (prompt processing and the first token of each row),
        ``decode_time_s``, ``decode_tokens_per_s`` (``(new_tokens - rows) / decode_time_s``: each
        row's first token comes from prefill), ``prefill_tokens_per_s``, ``steps`` (target
        passes after prefill: decode or verify steps), ``batch``, ``max_len``, ``chunk_size``
        (effective), ``dtype``, ``mode`` (``"plain"`` or ``"dflash"``); with a drafter also
        :func:`spec_stats`'s.
    """

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    finish_reason: list[str]
    top2_logit_gaps: list[list[float]]
    texts: list[str] | None
    stats: dict


def spec_stats(state, rows: Sequence[int] | None = None, n_max=None) -> dict:
    """Speculative statistics of a finished state, summed over rows (``docs/specs/dflash.md`` 2.3).

    ``tau``: tokens committed per verify step, bonus included (the first token comes from
    prefill and is not counted, as in z-lab's benchmark; :attr:`DecodeState.committed`); under
    ``n_max="auto"`` its plain steps count as verify steps of the anchor alone.
    ``accepted_per_position[i]``: the fraction of verify steps in which draft position ``i + 1``
    was accepted. Also ``verify_steps``, ``drafted_tokens``, ``accepted_tokens``, ``n_max``
    (the given ``n_max``, e.g. ``"auto"``, else the drafted depth), ``widths`` (steps that
    proposed and verified ``w`` drafts, or a tree of ``w`` nodes, ``w = 0..depth`` (or the tree's
    nodes); batch steps, not rows) and
    ``plain_steps`` (batch steps without a propose).

    Args:
      state: a :class:`~dflash_jax.state.DecodeState` with a speculative extension.
      rows: sum over these rows only (a server reads one request's row); ``verify_steps`` is
        then their own verify passes rather than the batch's target passes (``widths`` and
        ``plain_steps`` stay the batch's).
      n_max: the depth the generation was asked for, reported as given (default: the drafted one).
    """
    sp = state.speculative  # the statistics only: the drafter context stays on device
    fields = (sp.verify_steps, sp.accepted_per_position, sp.drafted, sp.accepted, state.length, state.prompt_len, sp.widths)
    verify, per_pos, drafted, accepted, length, prompt_len, widths = fetch(fields)
    committed = np.maximum(length - prompt_len - 1, 0)  # DecodeState.committed, on the host: no program per batch size
    passes = total = int(fetch(state.steps))
    if rows is not None:
        idx = np.asarray(rows, np.int64)
        verify, per_pos, drafted, accepted, committed = (a[idx] for a in (verify, per_pos, drafted, accepted, committed))
        passes = int(np.sum(verify))
    steps = int(np.sum(verify))
    return dict(
        tau=round(float(np.sum(committed)) / steps, 4) if steps else 0.0,
        verify_steps=passes,
        accepted_per_position=[round(float(x) / steps, 4) if steps else 0.0 for x in np.sum(per_pos, axis=0)],
        drafted_tokens=int(np.sum(drafted)),
        accepted_tokens=int(np.sum(accepted)),
        n_max=int(per_pos.shape[1]) if n_max is None else n_max,
        widths=[int(x) for x in widths],
        plain_steps=total - int(np.sum(widths)),
    )


def _rows(tokenizer, state, batch: int, stop_texts: Sequence[str]):
    """Per row ``(ids, gaps, finish reason, text or None)``, cut at the first stop text."""
    tokens, plen, length, finish, gaps = fetch((state.tokens, state.prompt_len, state.length, state.finish, state.gaps))
    for b in range(batch):
        ids = [int(t) for t in tokens[b, plen[b] : length[b]]]
        g = [float(x) for x in gaps[b, plen[b] : length[b]]]
        reason = FINISH_REASONS[int(finish[b])] or "length"
        cut = cut_at_stop_text(tokenizer, ids, stop_texts) if stop_texts else None
        if cut is not None:
            ids, g, reason = ids[:cut], g[:cut], "stop"
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            c = find_stop(text, stop_texts)
            text = text if c is None else text[:c]
        yield ids, g, reason, text


def build_result(target, prompts: list[list[int]], state, stop_texts: Sequence[str], timings: Mapping[str, float],
                 **extra_stats) -> GenerationResult:
    """Reads a finished decode state back into a :class:`GenerationResult` (shared by every mode).

    Args:
      target: the :class:`~dflash_jax.loading.Target` (its tokenizer decodes the texts).
      prompts: the prompts the state was built from.
      state: a :class:`~dflash_jax.state.DecodeState` after generation.
      stop_texts: stop texts to cut the outputs at: each row's ids end with the token that
        completed the first stop text, its text just before it.
      timings: ``compile_time_s``, ``prefill_time_s``, ``decode_time_s`` in seconds.
      extra_stats: added to ``stats`` as given (``mode``, ``max_len``, ...).
    """
    batch = len(prompts)
    out_ids, out_gaps, reasons, texts = (list(x) for x in zip(*_rows(target.tokenizer, state, batch, stop_texts)))
    plen, length, steps = fetch((state.prompt_len, state.length, state.steps))
    generated = int(np.sum(length - plen))  # before any stop-text cut: what the loop produced
    decode_tokens = generated - batch  # each row's first token comes from prefill
    prefill_s, decode_s = float(timings["prefill_time_s"]), float(timings["decode_time_s"])
    stats = dict(
        mode="plain",
        batch=batch,
        prompt_tokens=int(np.sum(plen)),
        new_tokens=sum(len(x) for x in out_ids),
        generated_tokens=generated,
        steps=int(steps),
        compile_time_s=round(float(timings["compile_time_s"]), 6),
        prefill_time_s=round(prefill_s, 6),
        decode_time_s=round(decode_s, 6),
        prefill_tokens_per_s=round(float(np.sum(plen)) / prefill_s, 3) if prefill_s > 0 else None,
        decode_tokens_per_s=round(decode_tokens / decode_s, 3) if decode_s > 0 and decode_tokens > 0 else 0.0,
        dtype=target.cfg.dtype,
    )
    stats.update(extra_stats)
    return GenerationResult(prompt_ids=[list(p) for p in prompts], output_ids=out_ids, finish_reason=reasons,
                            top2_logit_gaps=out_gaps, texts=texts if target.tokenizer is not None else None, stats=stats)
