"""Commit: the verified block joins the state (tokens, lengths, drafter context, statistics).

Rollback of the rejected drafts is the length update of :func:`dflash_jax.state.commit`: the
target cache and the drafter context keep no length of their own, and their rows beyond a row's
committed length stay masked until the next block overwrites them. A target family with recurrent
state (Gated DeltaNet, :mod:`dflash_jax.models.qwen3_5`) also has ``commit_block_states``: the
states after the committed block positions of each row, chosen from those its verify pass kept.
"""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.decoding import Decoding, Params
from dflash_jax.registry import module_for
from dflash_jax.speculative.capture import absorb_context
from dflash_jax.speculative.verify import Verdict
from dflash_jax.state import DecodeState, commit


def commit_block(params: Params, state: DecodeState, static: Decoding, verdict: Verdict) -> DecodeState:
    """Commits each running row's accepted drafts and bonus token (``accepted + 1`` tokens, cut at
    stop ids, budget and capacity by :func:`dflash_jax.state.commit`), projects the block's
    captured rows into the drafter context and counts statistics for running rows and kept
    tokens only. Counts one target pass (``steps``)."""
    running = ~state.done
    before = state.length
    state = commit(state.replace(cache=verdict.cache), verdict.tokens, verdict.accepted + 1, verdict.gaps)
    kept = state.length - before
    settle = module_for(static.target).commit_block_states  # recurrent families only (verify.py)
    if settle is not None:
        state = state.replace(cache=settle(static.target, state.cache, kept))
    ctx = absorb_context(params.drafter, static, state.speculative, verdict.capture)
    acc_kept = jnp.minimum(verdict.accepted, kept)
    pos = jnp.arange(1, ctx.n_max + 1, dtype=jnp.int32)[None, :]  # a verify may cover fewer positions
    ctx = ctx.replace(
        verify_steps=ctx.verify_steps + running,
        drafted=ctx.drafted + jnp.where(running, verdict.n_valid, 0),
        accepted=ctx.accepted + acc_kept,
        accepted_per_position=ctx.accepted_per_position + (pos <= acc_kept[:, None]),
    )
    return state.replace(speculative=ctx, steps=state.steps + 1)


def count_width(ctx, w, plain):
    """Counts a step that proposed and verified ``w`` drafts in ``widths`` (not a plain step:
    ``plain`` true). ``w``, ``plain``: scalars."""
    return ctx.replace(widths=ctx.widths.at[w].add(jnp.where(plain, 0, 1).astype(jnp.int32)))
