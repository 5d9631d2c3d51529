"""Capture: the target's hidden states at the drafter's chosen layers, into the drafter context.

Every target pass of a speculative generation (prefill chunks and verify blocks) runs with a
:class:`~dflash_jax.cache.Capture` buffer from :func:`block_capture`; :func:`absorb_context`
projects the captured rows into the drafter's context K/V at their absolute positions, so the
context never depends on how the tokens were split into passes.
"""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.cache import Capture, init_capture
from dflash_jax.decoding import Decoding
from dflash_jax.models import drafter
from dflash_jax.speculative.state import SpeculativeState


def block_capture(static: Decoding, base: jnp.ndarray, width: int) -> Capture:
    """An empty capture of ``width`` rows per row for the drafter's ``target_layer_ids``; the
    token at absolute position ``p`` lands in row ``p - base[b]`` (``base``: ``[B]`` int32)."""
    cfg_t, cfg_d = static.target, static.drafter
    return init_capture(cfg_d.target_layer_ids, base.shape[0], width, cfg_t.hidden_size, cfg_t.dtype, base=base,
                        post_norm_last=cfg_d.post_norm_last)


def absorb_context(params_d, static: Decoding, ctx: SpeculativeState, capture: Capture) -> SpeculativeState:
    """Projects the captured rows ``capture.hidden [B, T, K*H]`` (absolute positions
    ``capture.base[b] + t``) into the drafter context.

    Rows past a row's committed length may be written; they stay masked until overwritten.
    """
    positions = capture.base[:, None] + jnp.arange(capture.hidden.shape[1], dtype=jnp.int32)[None, :]
    k, v = drafter.context_kv(params_d, static.drafter, capture.hidden, positions)
    return ctx.replace(context=ctx.context.write_all(k, v, positions))
