"""The documented Python API: load a target, encode a prompt, generate (plain decoding).

Typical use::

    import dflash_jax as dj

    target = dj.load_target()                      # embedded SmolLM2-135M-Instruct (float32)
    ids = dj.encode_prompt(target, "What is 2 + 2?")   # chat template applied
    res = dj.generate(target, [ids], max_new_tokens=64)
    print(target.tokenizer.decode(res.output_ids[0], skip_special_tokens=True))
    print(res.stats)

Lower-level pieces (decode state, prefill, decode step, on-device loop) live in
:mod:`dflash_jax.decode`; :func:`generate` is a thin, timed driver over them. Every step is
compiled ahead of time (``jax.jit(...).lower(...).compile()``) before the clock starts, so the
reported times exclude compilation (which the persistent compilation cache makes cheap on a
second run).

Stop strings (``stop=``): a stop text that encodes to exactly one token id becomes a stop id and
ends its row on device, like EOS. A longer stop text is checked on the decoded text: when
streaming (``on_tokens`` given) a row stops at the step whose text first contains it; without
streaming decoding continues on device and the output is cut afterwards. Either way (one token or
several) the row's ``output_ids`` end with the token that completed the first stop text in the
decoded output, ``texts`` end just before that stop text, and ``finish_reason`` is ``"stop"``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import decode
from dflash_jax.decoding import Decoding, Params
from dflash_jax.prefill import check_chunk_size, compile_prefill
from dflash_jax.errors import DFlashError
from dflash_jax.loading import (  # noqa: F401  (re-exported: dflash_jax.api.load_target etc.)
    DTYPES,
    LAYER_LAYOUTS,
    Drafter,
    Target,
    load_drafter,
    load_target,
    shipped_drafter,
    with_output_head,
)
from dflash_jax.sampling import SamplingConfig
from dflash_jax.state import FINISH_REASONS, STOP
from dflash_jax.text import TextStream, encode_prompt, split_stop  # noqa: F401 (TextStream, encode_prompt re-exported)
from dflash_jax.text import _cut_at_stop_text, _find_stop, _str_list


@dataclasses.dataclass
class GenerationResult:
    """What :func:`generate` returns.

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
        row's first token comes from prefill), ``prefill_tokens_per_s``, ``steps`` (decode
        passes), ``batch``, ``max_len``, ``chunk_size`` (effective), ``dtype``, ``mode``.
    """

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    finish_reason: list[str]
    top2_logit_gaps: list[list[float]]
    texts: list[str] | None
    stats: dict


# ------------------------------------------------------------------------------------- prompts


# ------------------------------------------------------------------------------------- generation


def default_max_len(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Longest prompt + ``max_new_tokens``, rounded up to a multiple of 64."""
    need = max(len(p) for p in prompts) + int(max_new_tokens)
    return 64 * math.ceil(need / 64)


def effective_chunk_size(chunk_size: int, max_prompt_len: int) -> int:
    """``chunk_size`` capped at the longest prompt rounded up to a multiple of 64.

    A chunk larger than the prompt only computes padding; the cap keeps short prompts cheap while
    bucketing their lengths so few shapes compile. The result does not depend on the chunk size.
    """
    return max(1, min(int(chunk_size), 64 * math.ceil(max_prompt_len / 64)))


def _check_target(target) -> None:
    if not isinstance(target, Target):
        raise DFlashError("target", f"got {type(target).__name__}", "a Target from load_target")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """``prompts`` as ``list[list[int]]``: rows may be lists, tuples, numpy or JAX integer arrays
    (a 2-D integer array is a batch of equal-length rows)."""
    if hasattr(prompts, "__array__") and not isinstance(prompts, (list, tuple)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise DFlashError("prompts", f"array of shape {arr.shape}", "a [batch, length] integer array or a list of token-id lists")
        prompts = list(arr)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise DFlashError("prompts", "not a non-empty list of token-id lists", "[[id, ...], ...]")
    out = []
    for b, p in enumerate(prompts):
        if hasattr(p, "__array__") and not isinstance(p, (list, tuple)):
            arr = np.asarray(p)
            if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
                raise DFlashError("prompts", f"prompt {b} is a {arr.dtype} array of shape {arr.shape}", "a 1-D integer array or a list of token ids")
            p = arr.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise DFlashError("prompts", f"prompt {b} is {type(p).__name__}", "a list of token ids (see encode_prompt)")
        for i in p:
            if not _is_int(i):
                raise DFlashError("prompt", f"prompt {b} holds {i!r} ({type(i).__name__})", "integer token ids")
        ids = [int(i) for i in p]
        if not ids:
            raise DFlashError("prompt", f"prompt {b} is empty", "at least one token")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise DFlashError("prompt", f"token id {bad[0]} outside the vocabulary", f"ids in [0, {vocab_size})")
        out.append(ids)
    return out


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    max_len: int | None = None,
    chunk_size: int = 256,
    stop_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    seed: int = 0,
    on_tokens: Callable[[list[list[int]]], Any] | None = None,
    drafter: Drafter | None = None,
    n_max: int | None = None,
    draft_mode: str = "argmax",
) -> GenerationResult:
    """Plain (non-speculative) generation for a batch of prompts.

    Args:
      target: from :func:`load_target`.
      prompts: ``B`` lists of token ids (lengths may differ); rows may also be 1-D integer numpy
        or JAX arrays, or the whole batch one ``[B, P]`` integer array.
      max_new_tokens: new-token budget per row (>= 1).
      sampling: :class:`~dflash_jax.sampling.SamplingConfig` (default greedy).
      max_len: capacity per row, prompt included; default: longest prompt + ``max_new_tokens``
        rounded up to a multiple of 64 (capped at the target's ``max_position_embeddings``, which
        neither may exceed). A row that fills it finishes with ``"capacity"``.
      chunk_size: prompt tokens per prefill pass (capped, see :func:`effective_chunk_size`).
      stop_ids: extra token ids that end a row (kept in the output).
      stop: stop texts (module docstring for how they are applied).
      ignore_eos: do not stop at the target's EOS ids.
      seed: PRNG seed for sampling, an integer in ``[0, 2**63)``.
      on_tokens: streaming callback, called with ``B`` lists of the ids each row committed since
        the previous call (the first call carries the token from prefill). With it, decoding is
        stepped from Python (``decode.stream``); without, it runs as one on-device loop.
      drafter: a :class:`Drafter` for DFlash speculative decoding (``None``: plain decoding).
        Stats then add ``tau`` (mean tokens committed per verify step, bonus included),
        ``verify_steps``, ``accepted_per_position`` (fraction of verify steps in which draft
        position ``i`` was accepted), ``drafted_tokens`` and ``accepted_tokens``.
      n_max: drafted tokens per block (default: the drafter's recorded ``n_max``, else its
        ``block_size - 1``).
      draft_mode: ``"argmax"`` (default) or ``"sample"`` proposals, see
        :class:`dflash_jax.decoding.Decoding`.
    Returns:
      :class:`GenerationResult`.
    Raises:
      DFlashError: bad prompts (non-integer or out-of-vocabulary ids), a prompt that does not fit
        ``max_len``, bad sizes, a capacity beyond the target's ``max_position_embeddings``, stop
        texts without a tokenizer, or an argument of the wrong type (the message names it).
    """
    _check_target(target)
    cfg, params, tok = target.cfg, target.params, target.tokenizer
    prompts = _check_prompts(prompts, cfg.vocab_size)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise DFlashError("max_new_tokens (--max-new-tokens)", f"got {max_new_tokens!r}", "an integer >= 1")
    check_chunk_size(chunk_size)
    if drafter is not None and not isinstance(drafter, Drafter):
        raise DFlashError("drafter", f"got {type(drafter).__name__}", "a Drafter from load_drafter or shipped_drafter, or None")
    if n_max is not None and not _is_int(n_max):
        raise DFlashError("n_max (--n-max)", f"got {n_max!r}", "an integer or None")
    if on_tokens is not None and not callable(on_tokens):
        raise DFlashError("on_tokens", f"got {type(on_tokens).__name__}", "a callable or None")
    stop = _str_list(stop, "stop", "--stop")
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (Sequence, np.ndarray)) or not all(_is_int(i) for i in stop_ids):
        raise DFlashError("stop_ids", f"got {stop_ids!r}", "a list of integer token ids")
    limit = int(cfg.max_position_embeddings)
    longest = max(len(p) for p in prompts)
    if max_len is None:
        if longest + max_new_tokens > limit:
            raise DFlashError("max_new_tokens (--max-new-tokens)", f"{max_new_tokens} after a prompt of {longest} tokens needs {longest + max_new_tokens} "
                              f"positions; the target has {limit} (max_position_embeddings)", f"at most {max(limit - longest, 0)}")
        max_len = min(default_max_len(prompts, max_new_tokens), limit)
    elif not _is_int(max_len) or max_len < 2:
        raise DFlashError("max_len (--max-len)", f"got {max_len!r}", "an integer >= 2")
    elif max_len > limit:
        raise DFlashError("max_len (--max-len)", f"{max_len} exceeds the target's {limit} positions (max_position_embeddings)", f"an integer in [2, {limit}]")
    max_len = int(max_len)
    # a budget beyond the capacity never applies; capping it keeps it within int32
    max_new_tokens = min(int(max_new_tokens), max_len)
    stop_tok_ids, _ = split_stop(tok, stop)
    stop_texts = list(stop)  # every stop text cuts the text, see the module docstring
    stops = [] if ignore_eos else list(target.eos_ids)
    for i in list(stop_ids) + stop_tok_ids:
        if int(i) not in stops:
            stops.append(int(i))
    batch = len(prompts)
    max_prompt = max(len(p) for p in prompts)
    chunk = effective_chunk_size(chunk_size, max_prompt)

    static = Decoding(cfg, None if drafter is None else drafter.cfg, sampling, draft_mode,
                      None if drafter is None else drafter.n_max if n_max is None else n_max)
    weights = Params(params, None if drafter is None else drafter.params)
    if not _is_int(seed):  # a PRNG key is for the low-level API (decode.init_state)
        raise DFlashError("seed (--seed)", f"got {seed!r}", "an integer in [0, 2**63)")
    state = decode.init_state(static, prompts, max_len, int(max_new_tokens), stops, seed)

    # ---- compile ahead of time (lowering traces shapes only; nothing runs); the compiled
    # functions take the dynamic arguments only
    t0 = time.perf_counter()
    prefill_c = compile_prefill(weights, state, static, chunk)
    if on_tokens is None:
        gen_c = decode.generate_until.lower(weights, state, static, jnp.int32(batch)).compile()
        run_c = lambda w, s: gen_c(w, s, jnp.int32(batch))  # noqa: E731
    else:
        run_c = decode.decode_step.lower(weights, state, static).compile()
    compile_s = time.perf_counter() - t0

    # ---- prefill (+ first token)
    jax.block_until_ready((weights, state))
    t0 = time.perf_counter()
    state = decode.prefill(weights, state, static, chunk, max_prompt, compiled=prefill_c)
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - t0

    # ---- decode
    callback_s = 0.0
    forced = np.zeros(batch, bool)
    t0 = time.perf_counter()
    if on_tokens is None:
        state = run_c(weights, state)
        jax.block_until_ready(state)
    else:
        streams = [TextStream(tok, stop_texts) for _ in range(batch)] if stop_texts else None

        def step(s):
            if forced.any():  # a stop text ended these rows: freeze them
                s = s.replace(finish=jnp.where(jnp.asarray(forced) & ~s.done, STOP, s.finish))
            return run_c(weights, s)

        for state, toks, counts in decode.stream(weights, state, static, step=step):
            new = [[int(t) for t in toks[b, : counts[b]]] if not forced[b] else [] for b in range(batch)]
            if streams is not None:
                for b in range(batch):
                    if new[b] and not forced[b]:
                        streams[b].feed(new[b])
                        forced[b] = streams[b].stopped
            c0 = time.perf_counter()
            on_tokens(new)
            callback_s += time.perf_counter() - c0
            if np.all(forced | np.asarray(jax.device_get(state.done))):
                break
        jax.block_until_ready(state)
    decode_s = time.perf_counter() - t0 - callback_s

    timings = dict(compile_time_s=compile_s, prefill_time_s=prefill_s, decode_time_s=decode_s)
    extra = {} if drafter is None else spec_stats(state)
    mode = "plain" if drafter is None else "dflash"
    return build_result(target, prompts, state, stop_texts, timings, mode=mode, max_len=max_len, chunk_size=chunk, **extra)


def spec_stats(state) -> dict:
    """Speculative statistics of a finished state, summed over rows (``docs/specs/dflash.md`` 2.3).

    ``tau``: tokens committed per verify step, bonus included (the first token comes from
    prefill and is not counted, as in z-lab's benchmark). ``accepted_per_position[i]``: the
    fraction of verify steps in which draft position ``i + 1`` was accepted.
    """
    sp = jax.device_get(state.speculative)
    steps = int(np.sum(sp.verify_steps))
    return dict(
        tau=round(float(np.sum(jax.device_get(state.committed))) / steps, 4) if steps else 0.0,
        verify_steps=int(jax.device_get(state.steps)),
        accepted_per_position=[round(float(x) / steps, 4) if steps else 0.0 for x in np.sum(sp.accepted_per_position, axis=0)],
        drafted_tokens=int(np.sum(sp.drafted)),
        accepted_tokens=int(np.sum(sp.accepted)),
        n_max=int(sp.accepted_per_position.shape[1]),
    )


def build_result(target: Target, prompts: list[list[int]], state, stop_texts: Sequence[str], timings: Mapping[str, float],
                 **extra_stats) -> GenerationResult:
    """Reads a finished decode state back into a :class:`GenerationResult` (shared by every mode).

    Args:
      target: the target (its tokenizer decodes the texts).
      prompts: the prompts the state was built from.
      state: a :class:`~dflash_jax.state.DecodeState` after generation.
      stop_texts: stop texts to cut the outputs at: each row's ids end with the token that
        completed the first stop text, its text just before it.
      timings: ``compile_time_s``, ``prefill_time_s``, ``decode_time_s`` in seconds.
      extra_stats: added to ``stats`` as given (``mode``, ``max_len``, ...).
    """
    tok = target.tokenizer
    batch = len(prompts)
    tokens, plen, length, finish, gaps, steps = jax.device_get(
        (state.tokens, state.prompt_len, state.length, state.finish, state.gaps, state.steps)
    )
    out_ids, reasons, out_gaps, texts = [], [], [], [] if tok is not None else None
    for b in range(batch):
        ids = [int(t) for t in tokens[b, plen[b] : length[b]]]
        g = [float(x) for x in gaps[b, plen[b] : length[b]]]
        reason = FINISH_REASONS[int(finish[b])] or "length"
        cut = _cut_at_stop_text(tok, ids, stop_texts) if stop_texts else None
        if cut is not None:
            ids, g, reason = ids[:cut], g[:cut], "stop"
        out_ids.append(ids)
        out_gaps.append(g)
        reasons.append(reason)
        if texts is not None:
            text = tok.decode(ids, skip_special_tokens=True)
            c = _find_stop(text, stop_texts)
            texts.append(text if c is None else text[:c])
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
                            top2_logit_gaps=out_gaps, texts=texts, stats=stats)
