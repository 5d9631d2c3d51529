"""The adaptive-depth step (``n_max="auto"``): propose the whole block (or skip the propose),
choose the verify width on device, verify and commit.

The width picks one of a few compiled verify branches (:func:`~dflash_jax.decode.auto.policy.verify_widths`,
and the anchor alone for a plain step), each a target pass over exactly ``w + 1`` tokens, so a
narrow verify costs what its width costs and no width ever compiles during a generation. The branches are while loops that run once or not at all
(:func:`run_one_of`) rather than ``lax.switch``: an XLA conditional copies the large buffers it
updates (the KV cache, the drafter context) on XLA:CPU, a while loop updates its carry in place.
The policy is :mod:`dflash_jax.decode.auto.policy`.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from dflash_jax.decode.state import Decoding, Params, check_depth_policy, check_step_inputs
from dflash_jax.decode.auto import policy as depth
from dflash_jax.decode.step import commit_block, count_width
from dflash_jax.decode.step import block_positions, propose_fn
from dflash_jax.decode.tree import tree_inputs, tree_of, verify_tree_fn
from dflash_jax.decode.step import verify_fn
from dflash_jax.decode.state import DecodeState


def step_fn(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """One adaptive step (pure): a plain step when the schedule says so, else propose the whole
    block (or tree) and verify the width the policy chooses."""
    plain = state.speculative.plain_left > 0

    def draft(_):  # a tree's drafter pass only: the tree is built outside the conditional (tree.tree_of)
        return tree_inputs(params, state, static) if static.tree else propose_fn(params, state, static)

    def skip(_):  # zeros of the propose's shapes: a plain step verifies the anchor alone
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(draft, None))

    drafted = jax.lax.cond(plain, skip, draft, None)
    if static.tree:
        return verify_chosen_tree(params, state, static, *tree_of(params, static, *drafted), plain)
    return verify_chosen(params, state, static, *drafted, plain)


def run_one_of(index, fns, operand):
    """``fns[index](operand)`` for a traced ``index``, as ``len(fns)`` while loops of which only
    the chosen one runs (once): ``lax.switch`` without its copies of the operand (module
    docstring). Every ``fns[k]`` maps the operand to a value of the same structure."""
    for k, f in enumerate(fns):
        operand = jax.lax.while_loop(lambda c: c[0], lambda c, f=f: (jnp.bool_(False), f(c[1])), (index == k, operand))[1]
    return operand


def verify_chosen(params: Params, state: DecodeState, static: Decoding, drafts, conf, plain) -> DecodeState:
    """Chooses the width from the confidences, verifies that many drafts and commits (pure).

    Args:
      drafts: ``[B, n]`` int32; conf: ``[B, n]`` float32 drafter confidences; plain: ``[]``
        bool, a plain step (verifies the anchor alone).
    Returns:
      The state after the step, its width counted and its plain-step schedule updated.
    Raises:
      DFlashError: ``params.depth`` missing or not fitting (at trace time).
    """
    n = static.depth
    check_depth_policy(params.depth, static)
    _, _, block_len = block_positions(state, n + 1)
    expected = depth.expected_tokens(params.depth, conf, block_len - 1)

    def verify_k(k, s):
        return commit_block(params, s, static, verify_fn(params, s, static, drafts[:, :k]))

    return _verify_one_width(params, state, static, expected, plain, verify_k)


def verify_chosen_tree(params: Params, state: DecodeState, static: Decoding, tree, conf, plain) -> DecodeState:
    """:func:`verify_chosen` over a best-first tree (``static.tree`` nodes): verifies its first
    ``w`` nodes, ``w`` one of ``static.auto_widths`` chosen from
    :func:`~dflash_jax.decode.auto.policy.tree_expected_tokens`."""
    check_depth_policy(params.depth, static)
    _, _, block_len = block_positions(state, static.width)
    expected = depth.tree_expected_tokens(params.depth, tree, conf, block_len - 1)

    def verify_k(k, s):
        if k == 0:  # the anchor alone: a plain step
            return commit_block(params, s, static, verify_fn(params, s, static, jnp.zeros((s.tokens.shape[0], 0), jnp.int32)))
        return commit_block(params, s, static, verify_tree_fn(params, s, static, tree.first(k)))

    return _verify_one_width(params, state, static, expected, plain, verify_k)


def _verify_one_width(params: Params, state: DecodeState, static: Decoding, expected, plain, verify_k) -> DecodeState:
    """Chooses the width of ``static.auto_widths`` from ``expected [B, m + 1]`` (tokens committed
    in expectation when ``w`` drafts are verified), runs ``verify_k(w, state)`` for it (``w = 0``:
    a plain step), counts the width and updates the plain-step schedule."""
    running = ~state.done
    live = jnp.max(jnp.where(running, state.length, 0))
    trust = state.speculative.trust
    j, pays = depth.choose_from(params.depth, depth.trusted(expected, trust), running, live, static.auto_widths)
    widths = (0, *static.auto_widths)  # branch 0: the anchor alone (a plain step)
    branch = jnp.where(plain, 0, j + 1)
    w = jnp.asarray(widths, jnp.int32)[branch]
    accepted = state.speculative.accepted
    state = run_one_of(branch, [functools.partial(verify_k, k) for k in widths], state)
    ctx = depth.schedule(params.depth, count_width(state.speculative, w, plain), plain, pays)
    trust = depth.update_trust(trust, expected, w, ctx.accepted - accepted, running & ~plain)
    return state.replace(speculative=ctx.replace(trust=trust))


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",))
def verify_auto(params: Params, state: DecodeState, static: Decoding, drafts, conf, plain=False) -> DecodeState:
    """Jitted :func:`verify_chosen` of given ``drafts [B, n]`` and confidences ``conf [B, n]``
    (``n = static.depth``), state donated: the adaptive step after its propose, for scripted
    drafters in tests and experiments. Raises DFlashError for arguments that do not go together
    (:func:`~dflash_jax.decode.state.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    return verify_chosen(params, state, static, drafts, conf, jnp.asarray(plain))
