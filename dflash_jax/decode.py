"""Plain (non-speculative) decoding: init, chunked prefill, decode step, on-device generate loop.

All steps are pure functions of ``(params, state)`` returning a new state; the jitted ones donate
the state. ``generate`` runs the whole loop on device with ``lax.while_loop``; ``stream`` steps
from Python and yields tokens as they are committed. ``generate_until`` and ``replace_rows`` make
continuous batching: finished rows take new prompts while the others keep decoding.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.axes import flat_axes
from dflash_jax.errors import DFlashError
from dflash_jax.registry import module_for
from dflash_jax.sampling import SamplingConfig, sample, top2_gap
from dflash_jax.state import DecodeState, commit


def pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token-id lists: returns ``([B, P] int32, [B] int32 lengths)``.

    Raises:
      DFlashError: an empty batch or an empty prompt.
    """
    if not prompts:
        raise DFlashError("prompt", "empty batch", "at least one prompt")
    lens = np.array([len(p) for p in prompts], np.int32)
    if (lens == 0).any():
        raise DFlashError("prompt", f"prompt {int(np.argmin(lens))} is empty", "at least one token")
    out = np.zeros((len(prompts), int(lens.max())), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = np.asarray(p, np.int32)
    return out, lens


def init_state(
    cfg,
    prompts: Sequence[Sequence[int]],
    max_len: int,
    max_new_tokens: int | Sequence[int],
    stop_ids: Sequence[int] = (),
    seed: int | jax.Array = 0,
    spec=None,
) -> DecodeState:
    """A fresh decode state holding the prompts, with an empty target cache of ``max_len`` slots.

    Args:
      cfg: target config.
      prompts: ``B`` lists of token ids (lengths may differ).
      max_len: capacity in tokens per row (prompt + generated).
      max_new_tokens: new-token budget, one int for all rows or one per row.
      stop_ids: token ids that end a row (EOS included by the caller).
      seed: int seed or a PRNG key.
      spec: optional speculative-decoding extension (see ``dflash_jax.spec``).
    Raises:
      DFlashError: a prompt that leaves no room for one new token within ``max_len``; a seed that
        is neither an integer in ``[0, 2**63)`` nor a key.
    """
    toks, lens = pad_prompts(prompts)
    if int(lens.max()) + 1 > max_len:
        raise DFlashError(
            "max_len (--max-len)", f"prompt of {int(lens.max())} tokens leaves no room in a capacity of {max_len}", f"max_len >= {int(lens.max()) + 1}"
        )
    b = toks.shape[0]
    tokens = np.zeros((b, max_len), np.int32)
    tokens[:, : toks.shape[1]] = toks
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,)).copy()
    if (max_new < 1).any():
        raise DFlashError("max_new_tokens (--max-new-tokens)", f"got {int(max_new.min())}", "an integer >= 1")
    stops = np.asarray(list(stop_ids) or [-1], np.int32)
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
        if not 0 <= seed < 2**63:
            raise DFlashError("seed (--seed)", f"got {seed}", "an integer in [0, 2**63)")
        key = jax.random.key(int(seed))
    elif isinstance(seed, jax.Array):
        key = seed
    else:
        raise DFlashError("seed (--seed)", f"got {seed!r}", "an integer in [0, 2**63) or a PRNG key")
    mod = module_for(cfg)
    return DecodeState(
        tokens=jnp.asarray(tokens),
        length=jnp.asarray(lens),
        prompt_len=jnp.asarray(lens),
        max_new=jnp.asarray(max_new),
        stop_ids=jnp.asarray(stops),
        cache=mod.init_cache(cfg, b, max_len),
        rng=key,
        finish=jnp.zeros((b,), jnp.int32),
        gaps=jnp.zeros((b, max_len), jnp.float32),
        steps=jnp.zeros((), jnp.int32),
        spec=spec,
    )


def prefill_chunk_forward(params, cfg, state: DecodeState, logits_acc, start, chunk_size: int, capture=None):
    """Feeds prompt positions ``[start, start + chunk_size)`` of every row to the target.

    Rows whose prompt ends inside the chunk store the logits of their last prompt token in
    ``logits_acc`` (``[B, V]`` float32). Positions past a row's prompt write K/V to slots that are
    never written (they get the padding position ``capacity``). Returns ``(state, logits_acc, capture)``.
    """
    mod = module_for(cfg)
    b = state.tokens.shape[0]
    padded = jnp.pad(state.tokens, ((0, 0), (0, chunk_size)))
    chunk = jax.lax.dynamic_slice_in_dim(padded, start, chunk_size, axis=1)
    positions = start + jnp.broadcast_to(jnp.arange(chunk_size, dtype=jnp.int32), (b, chunk_size))
    # Rows past a prompt get the out-of-range position ``capacity``: their K/V is dropped rather
    # than written, so a ring cache (sliding-window layers) never loses an in-window row to them.
    positions = jnp.where(positions < state.prompt_len[:, None], positions, state.capacity)
    hidden, cache, capture = mod.forward_hidden(params, cfg, chunk, positions, state.cache, capture)
    idx = state.prompt_len - 1 - start
    in_chunk = (idx >= 0) & (idx < chunk_size)
    last = jnp.take_along_axis(hidden, jnp.clip(idx, 0, chunk_size - 1)[:, None, None], axis=1)[:, 0]
    logits = mod.lm_head(params, cfg, last)
    logits_acc = jnp.where(in_chunk[:, None], logits, logits_acc)
    return state.replace(cache=cache), logits_acc, capture


@functools.partial(jax.jit, static_argnames=("cfg", "chunk_size"), donate_argnames=("state", "logits_acc"))
def prefill_chunk(params, cfg, state: DecodeState, logits_acc, start, chunk_size: int):
    """Jitted :func:`prefill_chunk_forward` without capture; ``start`` is traced (one compile)."""
    state, logits_acc, _ = prefill_chunk_forward(params, cfg, state, logits_acc, start, chunk_size)
    return state, logits_acc


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("state",))
def finish_prefill(state: DecodeState, logits_acc, sampling: SamplingConfig) -> DecodeState:
    """Samples each row's first new token from its last prompt row's logits and commits it."""
    rng, key = jax.random.split(state.rng)
    first = sample(key, logits_acc, sampling)
    state = state.replace(rng=rng)
    return commit(state, first[:, None], jnp.ones_like(first), top2_gap(logits_acc)[:, None])


def prefill(params, cfg, state: DecodeState, chunk_size: int, sampling: SamplingConfig, max_prompt_len: int | None = None) -> DecodeState:
    """Chunked prefill of every prompt, then the first new token (sampled from the last prompt row).

    Args:
      params, cfg: the target.
      state: from :func:`init_state`.
      chunk_size: prompt tokens per target pass; the result does not depend on it.
      sampling: :class:`SamplingConfig` for the first token.
      max_prompt_len: longest prompt (read from ``state`` when omitted: one host sync).
    Returns:
      The state with ``length = prompt_len + 1`` (or done, if the first token stops the row).
    """
    if chunk_size < 1:
        raise DFlashError("chunk_size (--chunk-size)", f"got {chunk_size}", "an integer >= 1")
    if max_prompt_len is None:
        max_prompt_len = int(jax.device_get(state.prompt_len).max())
    acc = jnp.zeros((state.tokens.shape[0], cfg.vocab_size), jnp.float32)
    for start in range(0, max_prompt_len, chunk_size):
        state, acc = prefill_chunk(params, cfg, state, acc, jnp.int32(start), chunk_size)
    return finish_prefill(state, acc, sampling)


def decode_step_fn(params, cfg, state: DecodeState, sampling: SamplingConfig) -> DecodeState:
    """One target pass over each row's last committed token; commits one sampled token per row."""
    mod = module_for(cfg)
    b = state.tokens.shape[0]
    pos = jnp.maximum(state.length - 1, 0)
    tok = jnp.take_along_axis(state.tokens, pos[:, None], axis=1)
    hidden, cache, _ = mod.forward_hidden(params, cfg, tok, pos[:, None], state.cache)
    logits = mod.lm_head(params, cfg, hidden[:, 0])
    rng, key = jax.random.split(state.rng)
    nxt = sample(key, logits, sampling)
    state = state.replace(cache=cache, rng=rng, steps=state.steps + 1)
    return commit(state, nxt[:, None], jnp.ones((b,), jnp.int32), top2_gap(logits)[:, None])


decode_step = jax.jit(decode_step_fn, static_argnames=("cfg", "sampling"), donate_argnames=("state",))
decode_step.__doc__ = "Jitted :func:`decode_step_fn` (state donated)."


def steps_until(step, state: DecodeState, min_done) -> DecodeState:
    """Runs ``step`` on device (``lax.while_loop``) until ``min_done`` rows are done or all are,
    and at most ``capacity`` steps from here (every row finishes within that many, as each step
    commits at least one token per running row). The loop of plain and speculative
    ``generate``/``generate_until``; call it inside a jitted function.

    Args:
      step: a pure ``DecodeState -> DecodeState`` function (one decode or speculative step).
      state: ``B`` rows.
      min_done: ``[]`` int32 or int, the number of done rows to stop at.
    Returns:
      The state after the steps taken.
    """
    start, limit = state.steps, state.capacity

    def cond(s):
        return (jnp.sum(s.done) < min_done) & ~jnp.all(s.done) & (s.steps - start < limit)

    return jax.lax.while_loop(cond, step, state)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("state",))
def generate(params, cfg, state: DecodeState, sampling: SamplingConfig) -> DecodeState:
    """Decodes until every row is done, on device (``lax.while_loop``), after :func:`prefill`."""
    return steps_until(lambda s: decode_step_fn(params, cfg, s, sampling), state, state.done.shape[0])


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("state",))
def generate_until(params, cfg, state: DecodeState, sampling: SamplingConfig, min_done) -> DecodeState:
    """Decodes until at least ``min_done`` rows are done (or all are), on device.

    The building block of continuous batching: the caller collects the finished rows and puts new
    prompts in their place with :func:`replace_rows`, so no row idles until the longest answer
    ends. Also stops after ``capacity`` steps (every row finishes within that many).

    Args:
      state: after :func:`prefill` (donated), ``B`` rows.
      min_done: ``[]`` int32 (traced: one compile for every value); done rows count whether they
        finished in this call or before.
    Returns:
      The state after the steps taken (a done row never changes).
    """
    return steps_until(lambda s: decode_step_fn(params, cfg, s, sampling), state, min_done)


@functools.partial(jax.jit, donate_argnames=("state",))
def replace_rows(state: DecodeState, fresh: DecodeState, rows) -> DecodeState:
    """``state`` with its rows ``rows`` replaced by the rows of ``fresh`` (continuous batching).

    Every array whose declared axes (:func:`dflash_jax.axes.axes_field`) include ``"batch"``
    (tokens, lengths, budgets, finish codes, gaps, every cache array and a speculative state's
    drafter context and statistics) takes ``fresh``'s row ``j`` at row
    ``rows[j]``; the rest (stop ids, PRNG key, step counter) stays ``state``'s. ``fresh`` is
    typically a prefilled :func:`init_state` of the new prompts with the same capacity.

    Args:
      state: the running state (donated), ``B`` rows.
      fresh: a state of ``R <= B`` rows of the same model, capacity and extension.
      rows: ``[R]`` int32 distinct row indices of ``state``.
    Raises:
      DFlashError: ``fresh`` does not match ``state`` apart from the batch axis.
    """
    r = rows.shape[0]
    paths, tdef = jax.tree_util.tree_flatten_with_path(state)
    new, ndef = jax.tree_util.tree_flatten(fresh)
    if ndef != tdef:
        raise DFlashError("replace_rows fresh", f"a state of structure {ndef}", f"the running state's structure {tdef}")
    axes = flat_axes(state)  # one declared axes tuple per array
    out = []
    for (path, old), ax, x in zip(paths, axes, new):
        if "batch" not in ax:
            out.append(old)
            continue
        i = ax.index("batch")
        want = old.shape[:i] + (r,) + old.shape[i + 1 :]
        if x.shape != want or x.dtype != old.dtype:
            raise DFlashError(f"replace_rows fresh{jax.tree_util.keystr(path)}", f"{x.dtype}{list(x.shape)}", f"{old.dtype}{list(want)}")
        out.append(old.at[(slice(None),) * i + (rows,)].set(x))
    return jax.tree_util.tree_unflatten(tdef, out)


def stream(params, cfg, state: DecodeState, sampling: SamplingConfig, step=None) -> Iterator[tuple[DecodeState, np.ndarray, np.ndarray]]:
    """Python-stepped decoding for streaming, after :func:`prefill`.

    Yields ``(state, new_tokens, new_counts)`` after each step, where ``new_tokens`` is ``[B, K]``
    int32 (host) of which the first ``new_counts[b]`` are new for row ``b``. The first yield
    reports the token chosen by prefill. ``step`` defaults to the jitted plain decode step.
    """
    step = step or (lambda s: decode_step(params, cfg, s, sampling))
    length = np.asarray(jax.device_get(state.prompt_len))
    while True:
        tokens, new_len, done = jax.device_get((state.tokens, state.length, state.done))
        counts = new_len - length
        k = int(counts.max()) if counts.size else 0
        if k:
            idx = np.minimum(length[:, None] + np.arange(k)[None, :], tokens.shape[1] - 1)
            yield state, np.take_along_axis(tokens, idx, axis=1), counts
        length = new_len
        if done.all():
            return
        state = step(state)
