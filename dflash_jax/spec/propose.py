"""Propose: the drafter drafts one block ``[anchor, MASK, ...]`` in a single forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig
from dflash_jax.models import drafter
from dflash_jax.sampling import SamplingConfig, probabilities, warp_logits
from dflash_jax.state import DecodeState

DRAFT_MODES = ("argmax", "sample")


def block_positions(state: DecodeState, width: int):
    """``(start [B], positions [B, W], block_len [B])`` of the next block.

    ``start`` is the anchor's position (the row's last committed token). ``block_len`` shortens
    the final block to the tokens still allowed (budget and capacity), as z-lab's
    ``dflash_generate`` does with ``verify_size``.
    """
    start = state.length - 1
    positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    room = jnp.minimum(state.prompt_len + state.max_new, state.capacity) - start
    return start, positions, jnp.clip(room, 1, width).astype(jnp.int32)


def propose_fn(
    params_t, cfg_t, params_d, cfg_d: DrafterConfig, state: DecodeState, width: int, sampling: SamplingConfig, draft_mode: str = "argmax", key=None
):
    """Drafts ``width - 1`` tokens per row.

    Args:
      width: block width ``n_max + 1`` (static).
      sampling: the target's sampling settings (the drafter's distribution is warped the same way).
      draft_mode: ``"argmax"`` proposes the drafter's argmax (one-hot proposal distribution; the
        default, see docs/specs/dflash.md 2.2) or ``"sample"`` draws each position from the warped
        drafter distribution (z-lab PyPI behaviour).
      key: PRNG key for ``"sample"``.
    Returns:
      ``(drafts [B, W-1] int32, q [B, W-1, V] float32 or None)``; ``q`` is the proposal
      distribution when it is not one-hot (zero outside a draft vocabulary, when the drafter
      has one).
    """
    if draft_mode not in DRAFT_MODES:
        raise ValueError(f"draft_mode must be one of {DRAFT_MODES}, got {draft_mode!r}")
    start, positions, block_len = block_positions(state, width)
    anchor = jnp.take_along_axis(state.tokens, start[:, None], axis=1)
    b = anchor.shape[0]
    block = jnp.concatenate([anchor, jnp.full((b, width - 1), cfg_d.mask_token_id, jnp.int32)], axis=1)
    hidden = drafter.forward(params_d, cfg_d, params_t, cfg_t, block, positions, state.spec.ctx_k, state.spec.ctx_v, start, block_len)
    lg = drafter.logits(params_d, cfg_d, params_t, cfg_t, hidden[:, 1:])
    if sampling.greedy or draft_mode == "argmax":
        return drafter.draft_token_ids(params_d, cfg_d, jnp.argmax(lg, axis=-1)), None
    drafts = drafter.draft_token_ids(params_d, cfg_d, jax.random.categorical(key, warp_logits(lg, sampling), axis=-1))
    q = probabilities(lg, sampling)
    if cfg_d.draft_vocab_size:  # no proposal mass outside the draft vocabulary
        q = jnp.zeros(q.shape[:-1] + (cfg_d.vocab_size,), q.dtype).at[..., params_d["draft_ids"]].set(q)
    return drafts, q
