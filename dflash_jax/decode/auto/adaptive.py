"""The adaptive-depth step (``n_max="auto"``): a plain step, or propose the whole block, choose
the verify width on device, verify and commit.

A step is one of two branches: the plain step (the anchor alone through the target, captured for
the drafter context; nothing else of the drafter's path runs) or the drafting step, which
proposes, chooses one of a few compiled verify widths
(:func:`~dflash_jax.decode.auto.policy.verify_widths`), each a target pass over exactly ``w + 1``
tokens, and commits; so a narrow verify costs what its width costs, a plain step about what a step
of plain decoding costs, and no width ever compiles during a generation. Every branch is a while
loop that runs once or not at all (:func:`run_one_of`) rather than ``lax.switch``: an XLA
conditional copies the large buffers it updates (the KV cache, the drafter context) on XLA:CPU, a
while loop updates its carry in place. Before the plain step was its own branch, its propose was
skipped under a conditional but the tree, the expected tokens and the width choice ran on zeros:
a plain step cost 1.10x a plain-decoding step on a 2-core CPU, 1.0x after (BENCHMARKS.md,
"Speculation that never costs"). A plain step captures its token's target features into the
pending buffer (``SpeculativeState.pending``), projected into the drafter context
:data:`~dflash_jax.decode.state.PENDING_ROWS` at a time or before the next propose
(:func:`absorb_pending`), so the drafter's projection weights are not read at every plain step.
The policy is :mod:`dflash_jax.decode.auto.policy`.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from dflash_jax.decode.state import PENDING_ROWS, Decoding, Params, check_step_inputs
from dflash_jax.decode.auto import policy as depth
from dflash_jax.decode.step import absorb_context, block_capture, commit_block, count_width
from dflash_jax.decode.step import block_positions, propose_fn
from dflash_jax.decode.tree import tree_inputs, tree_of, verify_tree_fn
from dflash_jax.decode.step import verify_fn
from dflash_jax.decode.state import DecodeState


def step_fn(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """One adaptive step (pure): a plain step when the schedule says so (the anchor alone through
    the target, nothing of the drafter's path but the capture and, every
    :data:`~dflash_jax.decode.state.PENDING_ROWS` steps, the projection of the
    captured rows), else propose the whole block (or tree) and verify the width the policy
    chooses. The two are while loops of which one runs (:func:`run_one_of`), so a plain step costs
    what a step of plain decoding costs plus the capture."""
    plain = state.speculative.plain_left > 0

    def draft_step(s):
        if static.tree:
            return verify_chosen_tree(params, s, static, *tree_of(params, static, *tree_inputs(params, s, static)))
        return verify_chosen(params, s, static, *propose_fn(params, s, static))

    return _plain_or(params, state, static, plain, draft_step)


def _plain_or(params: Params, state: DecodeState, static: Decoding, plain, draft_step) -> DecodeState:
    """The plain step when ``plain`` (``[]`` bool) is true, else ``draft_step`` after the pending
    rows are projected (:func:`absorb_pending`): one of two while loops runs (:func:`run_one_of`).
    The plain step puts the anchor alone through the target, its features captured into the
    pending buffer (projected when it is full), commits one token per running row and uses one
    plain step of the schedule (the width counts and each row's trust unchanged)."""

    def plain_step(s):
        before, pending = s.length, pending_capture(static, s)
        verdict = verify_fn(params, s, static, jnp.zeros((s.tokens.shape[0], 0), jnp.int32), capture=pending)
        s = commit_block(params, s, static, verdict, absorb=False)
        n = s.speculative.pending_n + (s.length - before)  # the anchor's row joins a running row's pending
        ctx = depth.schedule(params.depth, s.speculative, jnp.bool_(True), jnp.bool_(False))
        s = s.replace(speculative=ctx.replace(pending=verdict.capture.hidden, pending_n=n))
        return run_one_of(jnp.where(jnp.any(n >= PENDING_ROWS), 0, 1), [lambda s: absorb_pending(params, s, static)], s)

    def drafting_step(s):
        waiting = jnp.any((s.speculative.pending_n > 0) & ~s.done)
        return draft_step(run_one_of(jnp.where(waiting, 0, 1), [lambda s: absorb_pending(params, s, static)], s))

    return run_one_of(plain.astype(jnp.int32), [drafting_step, plain_step], state)


def pending_capture(static: Decoding, state: DecodeState):
    """The pending buffer as a :class:`~dflash_jax.runtime.carry.Capture`: row ``t`` of row ``b``
    holds position ``length[b] - 1 - pending_n[b] + t``, so the next anchor (``length - 1``) lands
    in row ``pending_n``."""
    sp = state.speculative
    return block_capture(static, state.length - 1 - sp.pending_n, PENDING_ROWS).replace(hidden=sp.pending)


def absorb_pending(params: Params, state: DecodeState, static: Decoding) -> DecodeState:
    """Projects every row of the pending buffer into the drafter context in one product
    (:func:`~dflash_jax.decode.step.absorb_context`) and empties it (``pending_n`` 0). The rows
    past a row's ``pending_n`` land at positions from its anchor on, where the context is masked
    until a later capture overwrites them (:class:`~dflash_jax.decode.state.SpeculativeState`)."""
    sp = state.speculative
    ctx = absorb_context(params.drafter, static, sp, pending_capture(static, state))
    return state.replace(speculative=ctx.replace(pending_n=jnp.zeros_like(sp.pending_n)))


def run_one_of(index, fns, operand):
    """``fns[index](operand)`` for a traced ``index``, as ``len(fns)`` while loops of which only
    the chosen one runs (once): ``lax.switch`` without its copies of the operand (module
    docstring). Every ``fns[k]`` maps the operand to a value of the same structure."""
    for k, f in enumerate(fns):
        operand = jax.lax.while_loop(lambda c: c[0], lambda c, f=f: (jnp.bool_(False), f(c[1])), (index == k, operand))[1]
    return operand


def verify_chosen(params: Params, state: DecodeState, static: Decoding, drafts, conf) -> DecodeState:
    """Chooses the width from the confidences, verifies that many drafts and commits (pure).

    Args:
      drafts: ``[B, n]`` int32; conf: ``[B, n]`` float32 drafter confidences.
    Returns:
      The state after the step, its width counted and its plain-step schedule updated.
    Raises:
      DFlashError: ``params.depth`` missing or not fitting (at trace time).
    """
    n = static.depth
    depth.check_depth_policy(params.depth, static)
    _, _, block_len = block_positions(state, n + 1)
    expected = depth.expected_tokens(params.depth, conf, block_len - 1)

    def verify_k(k, s):
        return commit_block(params, s, static, verify_fn(params, s, static, drafts[:, :k]))

    return _verify_one_width(params, state, static, expected, verify_k)


def verify_chosen_tree(params: Params, state: DecodeState, static: Decoding, tree, conf) -> DecodeState:
    """:func:`verify_chosen` over a best-first tree (``static.tree`` nodes): verifies its first
    ``w`` nodes, ``w`` one of ``static.auto_widths`` chosen from
    :func:`~dflash_jax.decode.auto.policy.tree_expected_tokens`."""
    depth.check_depth_policy(params.depth, static)
    _, _, block_len = block_positions(state, static.width)
    expected = depth.tree_expected_tokens(params.depth, tree, conf, block_len - 1)

    def verify_k(k, s):
        return commit_block(params, s, static, verify_tree_fn(params, s, static, tree.first(k)))

    return _verify_one_width(params, state, static, expected, verify_k)


def _verify_one_width(params: Params, state: DecodeState, static: Decoding, expected, verify_k) -> DecodeState:
    """Chooses the width of ``static.auto_widths`` from ``expected [B, m + 1]`` (tokens committed
    in expectation when ``w`` drafts are verified), runs ``verify_k(w, state)`` for it, counts the
    width, updates the plain-step schedule and each row's trust."""
    running = ~state.done
    live = jnp.max(jnp.where(running, state.length, 0))
    trust = state.speculative.trust
    j, pays = depth.choose_from(params.depth, depth.trusted(expected, trust), running, live, static.auto_widths)
    widths = static.auto_widths
    w = jnp.asarray(widths, jnp.int32)[j]
    accepted = state.speculative.accepted
    state = run_one_of(j, [functools.partial(verify_k, k) for k in widths], state)
    ctx = depth.schedule(params.depth, count_width(state.speculative, w, jnp.bool_(False)), jnp.bool_(False), pays)
    trust = depth.update_trust(trust, expected, w, ctx.accepted - accepted, running)
    return state.replace(speculative=ctx.replace(trust=trust))


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",))
def verify_auto(params: Params, state: DecodeState, static: Decoding, drafts, conf, plain=False) -> DecodeState:
    """Jitted :func:`verify_chosen` of given ``drafts [B, n]`` and confidences ``conf [B, n]``
    (``n = static.depth``), state donated: the adaptive step after its propose, for scripted
    drafters in tests and experiments; ``plain`` true runs the plain step instead. Raises
    DFlashError for arguments that do not go together (:func:`~dflash_jax.decode.state.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    params = params.trees()
    return _plain_or(params, state, static, jnp.asarray(plain), lambda s: verify_chosen(params, s, static, drafts, conf))
