"""The DFlash loop: capture-aware prefill, jitted propose/verify steps, on-device generate.

``generate`` runs ``propose -> verify`` in a ``lax.while_loop`` with no host round trip per
step; ``stream`` steps from Python for streaming output; ``generate_until`` with
:func:`dflash_jax.decode.replace_rows` makes continuous batching. ``propose`` and ``verify`` are
also exposed as separate jitted steps for notebooks and experiments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax import decode
from dflash_jax.cache import init_capture
from dflash_jax.config import DrafterConfig, check_drafter_fits
from dflash_jax.errors import DFlashError
from dflash_jax.sampling import SamplingConfig
from dflash_jax.spec.propose import propose_fn
from dflash_jax.spec.state import absorb_context, init_spec_state
from dflash_jax.spec.verify import verify_fn
from dflash_jax.state import DecodeState


def check_n_max(cfg_d: DrafterConfig, n_max: int | None) -> int:
    """Resolves the proposal depth: ``None`` means ``block_size - 1``.

    Raises:
      DFlashError: ``n_max`` outside ``[1, block_size - 1]`` (names ``--n-max``).
    """
    n = cfg_d.block_size - 1 if n_max is None else int(n_max)
    if not 1 <= n <= cfg_d.block_size - 1:
        raise DFlashError("n_max (--n-max)", f"got {n_max}", f"an integer in [1, {cfg_d.block_size - 1}] (block_size - 1)")
    return n


def init_state(cfg_t, cfg_d: DrafterConfig, prompts, max_len: int, max_new_tokens, stop_ids=(), seed=0, n_max: int | None = None) -> DecodeState:
    """A decode state with an empty drafter context (see :func:`dflash_jax.decode.init_state`).

    Raises:
      DFlashError: a drafter that does not fit the target, or a bad ``n_max``.
    """
    check_drafter_fits(cfg_d, cfg_t)
    n = check_n_max(cfg_d, n_max)
    batch = len(prompts)
    return decode.init_state(cfg_t, prompts, max_len, max_new_tokens, stop_ids, seed, spec=init_spec_state(cfg_d, batch, max_len, n))


@functools.partial(jax.jit, static_argnames=("cfg_t", "cfg_d", "chunk_size"), donate_argnames=("state", "logits_acc"))
def prefill_chunk(params_t, cfg_t, params_d, cfg_d: DrafterConfig, state: DecodeState, logits_acc, start, chunk_size: int):
    """One prefill chunk that also captures every row of ``target_layer_ids`` into the context.

    Each captured row lands at its own absolute position, so the context after prefill does not
    depend on the chunk size (the micro-batch capture fault of docs/specs/bug_reports.md B18).
    """
    b = state.tokens.shape[0]
    base = jnp.full((b,), start, jnp.int32)
    capture = init_capture(cfg_d.target_layer_ids, b, chunk_size, cfg_t.hidden_size, cfg_t.dtype, base=base, post_norm_last=cfg_d.post_norm_last)
    state, logits_acc, capture = decode.prefill_chunk_forward(params_t, cfg_t, state, logits_acc, start, chunk_size, capture)
    positions = base[:, None] + jnp.arange(chunk_size, dtype=jnp.int32)[None, :]
    return state.replace(spec=absorb_context(params_d, cfg_d, state.spec, capture.hidden, positions)), logits_acc


def prefill(params_t, cfg_t, params_d, cfg_d, state: DecodeState, chunk_size: int, sampling: SamplingConfig, max_prompt_len: int | None = None) -> DecodeState:
    """Chunked prefill with capture, then the first token from the last prompt row.

    Args and result as :func:`dflash_jax.decode.prefill`; the drafter context then holds every
    prompt row.
    """
    if chunk_size < 1:
        raise DFlashError("chunk_size (--chunk-size)", f"got {chunk_size}", "an integer >= 1")
    if max_prompt_len is None:
        max_prompt_len = int(jax.device_get(state.prompt_len).max())
    acc = jnp.zeros((state.tokens.shape[0], cfg_t.vocab_size), jnp.float32)
    for start in range(0, max_prompt_len, chunk_size):
        state, acc = prefill_chunk(params_t, cfg_t, params_d, cfg_d, state, acc, jnp.int32(start), chunk_size)
    return decode.finish_prefill(state, acc, sampling)


def _keys(state: DecodeState):
    """Independent streams per step: drafting, acceptance, resampling."""
    rng, k_draft, k_accept, k_bonus = jax.random.split(state.rng, 4)
    return state.replace(rng=rng), k_draft, k_accept, k_bonus


def step_fn(params_t, cfg_t, params_d, cfg_d, state: DecodeState, sampling: SamplingConfig, draft_mode: str = "argmax") -> DecodeState:
    """One speculative step: propose a block, verify it, commit (pure, unjitted)."""
    state, k_draft, k_accept, k_bonus = _keys(state)
    width = state.spec.n_max + 1
    drafts, q = propose_fn(params_t, cfg_t, params_d, cfg_d, state, width, sampling, draft_mode, k_draft)
    return verify_fn(params_t, cfg_t, params_d, cfg_d, state, drafts, q, sampling, k_accept, k_bonus)


@functools.partial(jax.jit, static_argnames=("cfg_t", "cfg_d", "sampling", "draft_mode"))
def propose(params_t, cfg_t, params_d, cfg_d, state: DecodeState, sampling: SamplingConfig = SamplingConfig(), draft_mode: str = "argmax", key=None):
    """Jitted propose: ``(drafts [B, n_max] int32, q [B, n_max, V] or None)``; state is read only."""
    return propose_fn(params_t, cfg_t, params_d, cfg_d, state, state.spec.n_max + 1, sampling, draft_mode, key)


@functools.partial(jax.jit, static_argnames=("cfg_t", "cfg_d", "sampling"), donate_argnames=("state",))
def verify(params_t, cfg_t, params_d, cfg_d, state: DecodeState, drafts, q=None, sampling: SamplingConfig = SamplingConfig(), key_accept=None, key_bonus=None):
    """Jitted verify with the state donated (see :func:`dflash_jax.spec.verify.verify_fn`)."""
    return verify_fn(params_t, cfg_t, params_d, cfg_d, state, drafts, q, sampling, key_accept, key_bonus)


step = jax.jit(step_fn, static_argnames=("cfg_t", "cfg_d", "sampling", "draft_mode"), donate_argnames=("state",))
step.__doc__ = "Jitted :func:`step_fn` (state donated)."


@functools.partial(jax.jit, static_argnames=("cfg_t", "cfg_d", "sampling", "draft_mode"), donate_argnames=("state",))
def generate(params_t, cfg_t, params_d, cfg_d, state: DecodeState, sampling: SamplingConfig, draft_mode: str = "argmax") -> DecodeState:
    """Speculative decoding until every row is done, on device (``lax.while_loop``)."""
    return decode.steps_until(lambda s: step_fn(params_t, cfg_t, params_d, cfg_d, s, sampling, draft_mode), state, state.done.shape[0])


@functools.partial(jax.jit, static_argnames=("cfg_t", "cfg_d", "sampling", "draft_mode"), donate_argnames=("state",))
def generate_until(params_t, cfg_t, params_d, cfg_d, state: DecodeState, sampling: SamplingConfig, min_done, draft_mode: str = "argmax") -> DecodeState:
    """Speculative decoding until at least ``min_done`` rows are done (or all are), on device.

    Continuous batching for DFlash, as :func:`dflash_jax.decode.generate_until` is for plain
    decoding: the caller collects finished rows and gives them new prompts with
    :func:`dflash_jax.decode.replace_rows` (a prefilled :func:`init_state` of the new prompts,
    which carries their drafter context and zeroed statistics). Args and result as
    :func:`dflash_jax.decode.generate_until`, with ``state`` after :func:`prefill`.
    """
    return decode.steps_until(lambda s: step_fn(params_t, cfg_t, params_d, cfg_d, s, sampling, draft_mode), state, min_done)


def stream(params_t, cfg_t, params_d, cfg_d, state: DecodeState, sampling: SamplingConfig, draft_mode: str = "argmax"):
    """Python-stepped speculative decoding; yields like :func:`dflash_jax.decode.stream`."""
    return decode.stream(None, cfg_t, state, sampling, step=lambda s: step(params_t, cfg_t, params_d, cfg_d, s, sampling, draft_mode))
