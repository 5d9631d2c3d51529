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
from dflash_jax.speculative.tree import propose_tree_fn, verify_tree_fn
from dflash_jax.speculative.verify import verify_fn
from dflash_jax.state import DecodeState


def step_fn(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """One speculative step: propose a block, verify it, commit (pure, unjitted); under
    ``n_max="auto"`` the adaptive step; with ``static.tree`` a tree of drafts
    (:mod:`~dflash_jax.speculative.tree`, counted in ``widths`` at its nodes)."""
    if static.adaptive:
        return adaptive.step_fn(params, state, static)
    if static.tree:
        tree, _ = propose_tree_fn(params, state, static)
        state = commit_block(params, state, static, verify_tree_fn(params, state, static, tree))
        return state.replace(speculative=count_width(state.speculative, static.tree, jnp.bool_(False)))
    drafts, _ = propose_fn(params, state, static)
    return _verify_commit(params, state, static, drafts)


def _verify_commit(params: Params, state: DecodeState, static: Decoding, drafts) -> DecodeState:
    """Verifies all of ``drafts [B, n]`` and commits, counting the step at width ``n``."""
    state = commit_block(params, state, static, verify_fn(params, state, static, drafts))
    return state.replace(speculative=count_width(state.speculative, drafts.shape[1], jnp.bool_(False)))


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",))
def verify_block(params: Params, state: DecodeState, static: Decoding, drafts) -> DecodeState:
    """Jitted verify and commit of given ``drafts [B, n]`` int32, state donated: the new state.
    Raises DFlashError for arguments that do not go together
    (:func:`~dflash_jax.decoding.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    return _verify_commit(params, state, static, drafts)
