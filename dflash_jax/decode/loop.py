"""Decoding, plain or DFlash: init, prefill, one step, the on-device loop, continuous batching.

Every step has the signature ``f(params, state, static, ...)``: a
:class:`~dflash_jax.decode.state.Params` pytree (target and drafter weights), the
:class:`~dflash_jax.decode.state.DecodeState` carry and a :class:`~dflash_jax.decode.state.Decoding` (static:
configs, draft mode, depth; each row's sampling settings are in the state). With a drafter a step is a DFlash step
(:mod:`dflash_jax.decode.step`), else one plain target pass. The jitted steps donate the state.
``decode_loop`` runs the whole loop on device with ``lax.while_loop``; ``stream`` steps from Python
and yields tokens as they are committed. ``generate_until`` and ``replace_rows`` make continuous
batching: finished rows take new prompts while the others keep decoding.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode import logprobs as token_logprobs
from dflash_jax.decode.auto import adaptive
from dflash_jax.decode.prefill import (  # noqa: F401  (part of this API)
    compile_prefill,
    finish_prefill,
    prefill,
    prefill_chunk,
)
from dflash_jax.decode.sampling import (
    RowSampling,
    SamplingConfig,
    row_keys,
    sample_at,
    top2_gap,
)
from dflash_jax.decode.state import (
    RUNNING,
    DecodeState,
    Decoding,
    Params,
    check_step_inputs,
    commit,
    init_speculative_state,
)
from dflash_jax.decode.step import commit_block, count_width, propose_fn, proposal_fn, verify_commit
from dflash_jax.decode.tree import propose_tree_fn, verify_tree_fn
from dflash_jax.errors import DFlashError
from dflash_jax.families.registry import module_for
from dflash_jax.runtime.carry import flat_axes
from dflash_jax.runtime.distributed import fetch


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
    static: Decoding,
    prompts: Sequence[Sequence[int]],
    max_len: int,
    max_new_tokens: int | Sequence[int],
    stop_ids: Sequence[int] | Sequence[Sequence[int]] = (),
    seed: int | jax.Array | Sequence[int] = 0,
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    cache_len: int | None = None,
) -> DecodeState:
    """A fresh decode state holding the prompts, with an empty target cache of ``max_len`` slots
    (and, when ``static`` has a drafter, an empty drafter context and zeroed statistics).

    Args:
      static: the :class:`~dflash_jax.decode.state.Decoding` the state will be decoded with.
      prompts: ``B`` lists of token ids (lengths may differ).
      max_len: capacity in tokens per row (prompt + generated).
      max_new_tokens: new-token budget, one int for all rows or one per row.
      stop_ids: token ids that end a row (EOS included by the caller), the same for every row,
        or one list per prompt.
      seed: an int seed or a PRNG key (row ``b`` samples with ``fold_in(key, b)``), or one int
        seed per prompt (:func:`~dflash_jax.decode.sampling.row_keys`).
      sampling: a :class:`~dflash_jax.decode.sampling.SamplingConfig` for every row (default greedy),
        or one per prompt (:class:`~dflash_jax.decode.sampling.RowSampling`).
      cache_len: slots of the target cache and drafter context per row when fewer than
        ``max_len`` are needed (a serving batch prefills its prompts in a state of this many and
        moves them into its pages: :mod:`dflash_jax.serve.pages`); default ``max_len``.
    Raises:
      DFlashError: a prompt that leaves no room for one new token within ``max_len``; a budget
        below 1; stop ids, a seed or sampling settings that are none of these.
    """
    check_step_inputs(None, None, static)
    toks, lens = pad_prompts(prompts)
    if int(lens.max()) + 1 > max_len:
        raise DFlashError(
            "max_len (--max-len)", f"prompt of {int(lens.max())} tokens leaves no room in a capacity of {max_len}", f"max_len >= {int(lens.max()) + 1}"
        )
    b = toks.shape[0]
    tokens = np.zeros((b, max_len), np.int32)
    tokens[:, : toks.shape[1]] = toks
    max_new = np.asarray(max_new_tokens)
    if max_new.ndim > 1 or (max_new.ndim == 1 and max_new.shape[0] != b) or not np.issubdtype(max_new.dtype, np.integer) \
            or (max_new < 1).any() or (max_new >= 2**31).any():
        raise DFlashError("max_new_tokens (--max-new-tokens)", f"got {max_new_tokens!r}",
                          f"an integer in [1, 2**31), or one per prompt ({b})")
    max_new = np.broadcast_to(max_new.astype(np.int32), (b,)).copy()
    stops = _stop_rows(stop_ids, b)
    return DecodeState(
        tokens=jnp.asarray(tokens),
        length=jnp.asarray(lens),
        prompt_len=jnp.asarray(lens),
        max_new=jnp.asarray(max_new),
        stop_ids=jnp.asarray(stops),
        rng=row_keys(seed, b),
        sampling=RowSampling.of(sampling, b),
        **_empty_buffers(static, b, max_len, cache_len or max_len),
    )


def _stop_rows(stop_ids, rows: int) -> np.ndarray:
    """``[rows, n]`` int32 stop ids (``-1`` pads) from one list for all rows or one per row
    (DFlashError naming ``stop_ids`` otherwise)."""
    how = "a list of token ids (integers >= 0; -1 pads), or one such list per prompt"

    def ids(x) -> list[int]:
        arr = None if isinstance(x, (str, bytes)) else np.asarray(x)
        if arr is None or arr.ndim != 1 or (arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < -1 or arr.max() >= 2**31)):
            raise DFlashError("stop_ids", f"got {stop_ids!r}", how)
        return [int(i) for i in arr]

    if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__len__"):
        raise DFlashError("stop_ids", f"got {stop_ids!r}", how)
    per_row = any(np.ndim(x) > 0 or isinstance(x, (list, tuple)) for x in stop_ids)
    lists = [ids(x) for x in stop_ids] if per_row else [ids(list(stop_ids))] * rows
    if len(lists) != rows:
        raise DFlashError("stop_ids", f"got {len(lists)} lists for {rows} prompts", "one list per prompt, or one for all")
    out = np.full((rows, max(1, max(len(x) for x in lists))), -1, np.int32)
    for i, x in enumerate(lists):
        out[i, : len(x)] = x
    return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty_buffers(static: Decoding, b: int, max_len: int, cache_len: int) -> dict:
    """The state's zeroed buffers (target cache, drafter context, statistics) made by one program:
    eager ``jnp.zeros`` would dispatch one small program per shape, each looked up in the compile
    cache at every start."""
    speculative = None if static.drafter is None else init_speculative_state(
        static.drafter, b, cache_len, static.depth, static.verify_top, pending_dtype=static.target.dtype if static.adaptive else None)
    lp = None if static.logprobs is None else token_logprobs.empty(b, max_len, static.logprobs)
    return dict(cache=module_for(static.target).init_cache(static.target, b, cache_len), finish=jnp.zeros((b,), jnp.int32),
                gaps=jnp.zeros((b, max_len), jnp.float32), steps=jnp.zeros((), jnp.int32), speculative=speculative, logprobs=lp)


def plain_step_fn(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """One target pass over each row's last committed token; commits one sampled token per row."""
    cfg = static.target
    mod = module_for(cfg)
    b = state.tokens.shape[0]
    pos = jnp.maximum(state.length - 1, 0)
    tok = jnp.take_along_axis(state.tokens, pos[:, None], axis=1)
    hidden, cache, _ = mod.forward_hidden(params.target, cfg, tok, pos[:, None], state.cache)
    logits = mod.lm_head(params.target, cfg, hidden[:, 0])
    nxt = sample_at(state.rng, state.length[:, None], logits[:, None], state.sampling)[:, 0]
    state = state.replace(cache=cache, steps=state.steps + 1)
    lp = None if static.logprobs is None else token_logprobs.of_logits(logits[:, None], nxt[:, None], static.logprobs)
    return commit(state, nxt[:, None], jnp.ones((b,), jnp.int32), top2_gap(logits)[:, None], lp)


def speculative_step_fn(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """One speculative step: propose a block, verify it, commit (pure, unjitted); under
    ``n_max="auto"`` the adaptive step; with ``static.tree`` a tree of drafts
    (:mod:`~dflash_jax.decode.tree`, counted in ``widths`` at its nodes)."""
    if static.adaptive:
        return adaptive.step_fn(params, state, static)
    if static.tree:
        tree, _ = propose_tree_fn(params, state, static)
        state = commit_block(params, state, static, verify_tree_fn(params, state, static, tree))
        return state.replace(speculative=count_width(state.speculative, static.tree, jnp.bool_(False)))
    if static.draft_mode == "reject":  # the rejection rule reads the drafter's distributions
        proposal = proposal_fn(params, state, static)
        return verify_commit(params, state, static, proposal.drafts, proposal.logits)
    drafts, _ = propose_fn(params, state, static)
    return verify_commit(params, state, static, drafts)


def decode_step_fn(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """One step (pure, unjitted): a DFlash propose/verify/commit when ``static`` has a drafter
    (:func:`speculative_step_fn`), else one plain target pass (:func:`plain_step_fn`).
    Every running row commits at least one token. The arguments are not checked here: the entry
    points that call it (:func:`decode_step`, :func:`generate_until`) check them once."""
    if static.speculative:
        return speculative_step_fn(params, state, static)
    return plain_step_fn(params, state, static)


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",), keep_unused=True)
def decode_step(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """Jitted :func:`decode_step_fn` (state donated). Raises DFlashError for arguments that do not
    go together (:func:`~dflash_jax.decode.state.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    params = params.trees()
    return decode_step_fn(params, state, static)


def steps_until(step, state: DecodeState, min_done, max_steps=None) -> DecodeState:
    """Runs ``step`` on device (``lax.while_loop``) until ``min_done`` rows are done or all are,
    and at most ``capacity`` steps from here (every row finishes within that many, as each step
    commits at least one token per running row), or ``max_steps`` when given. The loop of plain
    and speculative ``decode_loop``/``generate_until``; call it inside a jitted function.

    Args:
      step: a pure ``DecodeState -> DecodeState`` function (one decode or speculative step).
      state: ``B`` rows.
      min_done: ``[]`` int32 or int, the number of done rows to stop at.
      max_steps: ``[]`` int32 or int, the most steps to take (``None``: ``capacity``); a server
        bounds the steps between two host round trips with it.
    Returns:
      The state after the steps taken.
    """
    start, limit = state.steps, state.capacity
    if max_steps is not None:
        limit = jnp.minimum(limit, max_steps)

    def cond(s):
        return (jnp.sum(s.done) < min_done) & ~jnp.all(s.done) & (s.steps - start < limit)

    return jax.lax.while_loop(cond, step, state)


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",), keep_unused=True)
def generate_until(params: Params, state: DecodeState, static: Decoding, min_done, max_steps=None) -> DecodeState:
    """Decodes until at least ``min_done`` rows are done (or all are), on device.

    The building block of continuous batching: the caller collects the finished rows and puts new
    prompts in their place with :func:`replace_rows`, so no row idles until the longest answer
    ends. Also stops after ``capacity`` steps (every row finishes within that many).

    Args:
      params, static: as :func:`decode_step`.
      state: after :func:`prefill` (donated), ``B`` rows.
      min_done: ``[]`` int32 (traced: one compile for every value); done rows count whether they
        finished in this call or before.
      max_steps: ``[]`` int32 (traced), the most steps this call takes, or ``None`` (no bound
        but ``capacity``); the serving engine returns to the host every few steps with it.
    Returns:
      The state after the steps taken (a done row never changes).
    Raises:
      DFlashError: arguments that do not go together (:func:`~dflash_jax.decode.state.check_step_inputs`).
    """
    check_step_inputs(params, state, static)
    params = params.trees()
    return steps_until(lambda s: decode_step_fn(params, s, static), state, min_done, max_steps)


def decode_loop(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """Decodes until every row is done, on device: :func:`generate_until` with all rows
    (``state`` after :func:`prefill`, donated)."""
    return generate_until(params, state, static, jnp.int32(state.tokens.shape[0]))


@functools.partial(jax.jit, donate_argnames=("state",))
def replace_rows(state: DecodeState, fresh: DecodeState, rows) -> DecodeState:
    """``state`` with its rows ``rows`` replaced by the rows of ``fresh`` (continuous batching).

    Every array whose declared axes (:func:`dflash_jax.runtime.carry.axes_field`) include ``"batch"``
    (tokens, lengths, budgets, finish codes, gaps, every cache array and a speculative state's
    drafter context and statistics) takes ``fresh``'s row ``j`` at row
    ``rows[j]`` (its PRNG key, sampling settings and stop ids too); the rest (the step counter)
    stays ``state``'s. ``fresh`` is
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


def stream(params: Params, state: DecodeState, static: Decoding, step=None) -> Iterator[tuple[DecodeState, np.ndarray, np.ndarray]]:
    """Python-stepped decoding for streaming, after :func:`prefill`.

    Yields ``(state, new_tokens, new_counts)`` after each step, where ``new_tokens`` is ``[B, K]``
    int32 (host) of which the first ``new_counts[b]`` are new for row ``b``. The first yield
    reports the token chosen by prefill. ``step`` (``state -> state``) defaults to the jitted
    :func:`decode_step`.
    """
    step = step or (lambda s: decode_step(params, s, static))
    length = np.asarray(fetch(state.prompt_len))
    while True:
        tokens, new_len, finish = fetch((state.tokens, state.length, state.finish))
        done = finish != RUNNING  # on the host: no device op per step
        counts = new_len - length
        k = int(counts.max()) if counts.size else 0
        if k:
            idx = np.minimum(length[:, None] + np.arange(k)[None, :], tokens.shape[1] - 1)
            yield state, np.take_along_axis(tokens, idx, axis=1), counts
        length = new_len
        if done.all():
            return
        state = step(state)
