"""One DFlash step: propose -> verify -> commit, pure (the on-device loop is
:func:`dflash_jax.decode.steps_until`, shared with plain decoding).

``propose_block`` (from :mod:`~dflash_jax.speculative.propose`) and ``verify_block`` (verify
and commit, state donated) are also exposed as separate jitted steps for notebooks and
experiments. Under ``n_max="auto"`` the step is :func:`dflash_jax.speculative.adaptive.step_fn`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.decoding import Decoding, Params, check_step_inputs
from dflash_jax.speculative import adaptive
from dflash_jax.speculative.commit import commit_block, count_width
from dflash_jax.speculative.propose import propose_fn
from dflash_jax.speculative.verify import verify_fn
from dflash_jax.state import DecodeState


def _keys(state: DecodeState):
    """Independent streams per step: drafting, acceptance, resampling."""
    rng, k_draft, k_accept, k_bonus = jax.random.split(state.rng, 4)
    return state.replace(rng=rng), k_draft, k_accept, k_bonus


def step_fn(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """One speculative step: propose a block, verify it, commit (pure, unjitted); under
    ``n_max="auto"`` the adaptive step."""
    state, k_draft, k_accept, k_bonus = _keys(state)
    if static.adaptive:
        return adaptive.step_fn(params, state, static, k_draft, k_accept, k_bonus)
    drafts, q = propose_fn(params, state, static, k_draft)
    return _verify_commit(params, state, static, drafts, q, k_accept, k_bonus)


def _verify_commit(params: Params, state: DecodeState, static: Decoding, drafts, q, k_accept, k_bonus) -> DecodeState:
    """Verifies all of ``drafts [B, n]`` and commits, counting the step at width ``n``."""
    state = commit_block(params, state, static, verify_fn(params, state, static, drafts, q, k_accept, k_bonus))
    return state.replace(speculative=count_width(state.speculative, drafts.shape[1], jnp.bool_(False)))


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",))
def verify_block(params: Params, state: DecodeState, static: Decoding, drafts, q=None, key_accept=None, key_bonus=None) -> DecodeState:
    """Jitted verify and commit of given ``drafts [B, n]`` (``q``: ``[B, n, V]`` or ``None`` for
    one-hot proposals; keys when sampling), state donated: the new state. Raises DFlashError for
    arguments that do not go together (:func:`~dflash_jax.decoding.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    return _verify_commit(params, state, static, drafts, q, key_accept, key_bonus)
