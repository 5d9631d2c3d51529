"""Chunked prefill, one loop for plain and speculative decoding.

The prompt is fed to the target ``chunk_size`` positions at a time (one compiled chunk shape
whatever the prompt lengths); with a drafter each chunk also captures the drafter's target layers
into its context. Then each row's first new token is sampled from its last prompt row's logits.
The result does not depend on ``chunk_size``.
"""

from __future__ import annotations

import functools
import numbers
import jax
import jax.numpy as jnp
from dflash_jax.runtime import compiled as executables
from dflash_jax.decode.state import Decoding, Params, check_step_inputs
from dflash_jax.runtime.distributed import fetch
from dflash_jax.errors import DFlashError
from dflash_jax.families.registry import module_for
from dflash_jax.decode import logprobs as token_logprobs
from dflash_jax.decode.sampling import sample_at, top2_gap
from dflash_jax.decode.step import absorb_context, block_capture
from dflash_jax.decode.state import DecodeState, commit


FEW_ROWS = 64
"""Prefill chunks of at most this many rows (batch x chunk) compile with :data:`FEW_ROWS_OPTIONS`
on the CPU backend."""
FEW_ROWS_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
"""XLA:CPU without its YNNPACK fusions: their first call in a process costs about 0.6 s more per
program, and at 64 rows the chunk runs no faster with them (1.35x faster at 256; BENCHMARKS.md,
"Time to first token"). A short prompt's prefill took 0.3 s instead of 0.8 s in a warm
``dflash-jax generate``."""


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` as an int; raises DFlashError (naming ``--chunk-size``) unless an integer >= 1."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise DFlashError("chunk_size (--chunk-size)", f"got {chunk_size!r}", "an integer >= 1")
    return int(chunk_size)


def prefill_chunk_fn(params: Params, state: DecodeState, static: Decoding, logits_acc, start, chunk_size: int):
    """Feeds prompt positions ``[start, start + chunk_size)`` of every row to the target.

    Rows whose prompt ends inside the chunk store the logits of their last prompt token in
    ``logits_acc`` (``[B, V]`` float32). Positions past a row's prompt get the padding position
    ``capacity`` (their K/V is dropped rather than written, so a ring cache never loses an
    in-window row to them). With a drafter, every row of the chunk is captured into the drafter
    context at its own absolute position (so the context does not depend on the chunk size: the
    micro-batch capture fault of docs/specs/bug_reports.md B18). Returns ``(state, logits_acc)``.
    """
    cfg, params = static.target, params.trees()
    mod = module_for(cfg)
    b = state.tokens.shape[0]
    padded = jnp.pad(state.tokens, ((0, 0), (0, chunk_size)))
    chunk = jax.lax.dynamic_slice_in_dim(padded, start, chunk_size, axis=1)
    positions = start + jnp.broadcast_to(jnp.arange(chunk_size, dtype=jnp.int32), (b, chunk_size))
    positions = jnp.where(positions < state.prompt_len[:, None], positions, state.capacity)
    capture = block_capture(static, jnp.full((b,), start, jnp.int32), chunk_size) if static.speculative else None
    hidden, cache, capture = mod.forward_hidden(params.target, cfg, chunk, positions, state.cache, capture)
    idx = state.prompt_len - 1 - start
    in_chunk = (idx >= 0) & (idx < chunk_size)
    last = jnp.take_along_axis(hidden, jnp.clip(idx, 0, chunk_size - 1)[:, None, None], axis=1)[:, 0]
    logits_acc = jnp.where(in_chunk[:, None], mod.lm_head(params.target, cfg, last), logits_acc)
    state = state.replace(cache=cache)
    if capture is not None:
        state = state.replace(speculative=absorb_context(params.drafter, static, state.speculative, capture))
    return state, logits_acc


prefill_chunk = jax.jit(prefill_chunk_fn, static_argnames=("static", "chunk_size"), donate_argnames=("state", "logits_acc"), keep_unused=True)
prefill_chunk.__doc__ = ("Jitted :func:`prefill_chunk_fn` (state and accumulator donated; ``start`` traced: one compile; every "
                         "argument kept, used or not, so that a compiled chunk names a sharding for each: :mod:`dflash_jax.runtime.compiled`).")


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",))
def finish_prefill(state: DecodeState, static: Decoding, logits_acc) -> DecodeState:
    """Samples each row's first new token from its last prompt row's logits and commits it."""
    first = sample_at(state.rng, state.length[:, None], logits_acc[:, None], state.sampling)[:, 0]
    lp = None if static.logprobs is None else token_logprobs.of_logits(logits_acc[:, None], first[:, None], static.logprobs)
    return commit(state, first[:, None], jnp.ones_like(first), top2_gap(logits_acc)[:, None], lp)


def compile_prefill(params: Params, state: DecodeState, static: Decoding, chunk_size: int):
    """``(chunk, finish)``, :func:`prefill_chunk` and :func:`finish_prefill` compiled ahead of time
    for these shapes: ``chunk(params, state, logits_acc, start)`` and ``finish(state, logits_acc)``
    (for :func:`prefill`'s ``compiled``; lowering traces shapes only, nothing runs). On the CPU
    backend a chunk of at most :data:`FEW_ROWS` rows compiles with :data:`FEW_ROWS_OPTIONS`."""
    rows = state.tokens.shape[0]
    acc = jnp.zeros((rows, static.target.vocab_size), jnp.float32)
    few = jax.default_backend() == "cpu" and rows * chunk_size <= FEW_ROWS
    chunk = executables.compile(prefill_chunk, params, state, static, acc, jnp.int32(0), chunk_size,
                                options=FEW_ROWS_OPTIONS if few else None)
    return chunk, executables.compile(finish_prefill, state, static, acc)


def prefill(params: Params, state: DecodeState, static: Decoding, chunk_size: int, max_prompt_len: int | None = None,
            compiled=None) -> DecodeState:
    """Chunked prefill of every prompt (with capture when ``static`` has a drafter), then the first
    new token (sampled from the last prompt row).

    Args:
      params, static: the weights and the decoding set-up.
      state: from :func:`dflash_jax.decode.loop.init_state` (donated).
      chunk_size: prompt tokens per target pass; the result does not depend on it.
      max_prompt_len: longest prompt (read from ``state`` when omitted: one host sync).
      compiled: ``(chunk, finish)`` from :func:`compile_prefill` of the same shapes (default: the
        jitted steps).
    Returns:
      The state with ``length = prompt_len + 1`` (or done, if the first token stops the row).
    Raises:
      DFlashError: ``chunk_size`` not an integer >= 1; arguments that do not go together
        (:func:`~dflash_jax.decode.state.check_step_inputs`).
    """
    check_step_inputs(params, state, static)
    chunk_size = check_chunk_size(chunk_size)
    if max_prompt_len is None:
        max_prompt_len = int(fetch(state.prompt_len).max())
    if compiled is None:
        compiled = (lambda p, s, a, t: prefill_chunk(p, s, static, a, t, chunk_size), lambda s, a: finish_prefill(s, static, a))
    chunk, finish = compiled
    acc = jnp.zeros((state.tokens.shape[0], static.target.vocab_size), jnp.float32)
    for start in range(0, max_prompt_len, chunk_size):
        state, acc = chunk(params, state, acc, jnp.int32(start))
    return finish(state, acc)
