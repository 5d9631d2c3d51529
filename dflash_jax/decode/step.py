"""One DFlash step's stages, pure and in data-flow order: capture, propose, verify, commit.

The loop that picks a step (chain, tree or adaptive) and runs it on device is
:mod:`dflash_jax.decode.loop`; this module holds what every speculative step is made of.

- **Capture.** Every target pass of a speculative generation (prefill chunks and verify blocks)
  runs with a :class:`~dflash_jax.runtime.carry.Capture` buffer from :func:`block_capture`;
  :func:`absorb_context` projects the captured rows into the drafter's context K/V at their
  absolute positions, so the context never depends on how the tokens were split into passes.
- **Propose.** The drafter drafts one block ``[anchor, MASK, ...]`` in a single forward pass
  (:func:`propose_fn`; jitted for notebooks as :func:`propose_block`).
- **Verify.** One target pass over the block ``[anchor, drafts]`` and the accept rule
  (:func:`verify_fn`). Accept rule (docs/specs/dflash.md 2.2, "sample and match"): the target
  chooses its own token at every slot of the block, the argmax when greedy, else its sample with
  the uniform of that token's position (:func:`dflash_jax.decode.sampling.sample_at`); the longest
  prefix of drafts equal to the target's tokens is accepted and the target's token after it is the
  bonus token. Every committed token is the target's own choice, so greedy output equals the
  target's greedy decode and sampled output is exactly the target's sample with the row's key (the
  same with or without a drafter). It equals Leviathan/Chen rejection sampling with a one-hot
  proposal; sampled drafts are coupled to the target's tokens through the shared uniform instead of
  a proposal distribution ``q``. ``Decoding(draft_mode="reject")`` accepts by the standard
  rejection rule instead (:func:`reject_rule`), measured against this one in BENCHMARKS.md.
- **Commit.** The verified block joins the state: tokens, lengths, drafter context, statistics
  (:func:`commit_block`). Rollback of the rejected drafts is the length update of
  :func:`dflash_jax.decode.state.commit`: the target cache and the drafter context keep no length
  of their own, and their rows beyond a row's committed length stay masked until the next block
  overwrites them. A target family with recurrent state (Gated DeltaNet,
  :mod:`dflash_jax.families.qwen3_5.model`) also has ``commit_block_states``: the states after the
  committed block positions of each row, chosen from those its verify pass kept.

:func:`verify_commit` verifies given drafts and commits them; :func:`verify_block` is its jitted
form (state donated) for notebooks and experiments.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.decode import logprobs as token_logprobs
from dflash_jax.decode.sampling import inverse_cdf, probabilities, sample_at, top2_gap, uniform_at
from dflash_jax.decode.state import DecodeState, SpeculativeState, commit
from dflash_jax.decode.state import Decoding, Params, check_step_inputs
from dflash_jax.drafter import model as drafter
from dflash_jax.families.registry import module_for
from dflash_jax.errors import DFlashError
from dflash_jax.runtime.carry import Capture, init_capture


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


class Proposal(NamedTuple):
    """One propose: the drafts and what they were drawn from.

    Attributes:
      drafts: ``[B, n]`` int32 target ids.
      conf: ``[B, n]`` float32 the top probability of the drafter's (unwarped) logits per slot.
      logits: ``[B, n, V']`` float32 the drafter's logits (``V'``: its draft vocabulary if any).
      candidates: ``[B, n, k]`` int32 a selector drafter's candidates per slot (DFlash2,
        :mod:`dflash_jax.drafter.selector`), else ``None``.
      q: ``[B, n, k]`` float32 the selector's distribution over ``candidates`` at each slot given
        the drafts before it (``softmax(score / T)``; one-hot for a greedy row or an argmax
        propose), else ``None`` (a generic drafter's ``q`` is its warped ``logits``).
    """

    drafts: jnp.ndarray
    conf: jnp.ndarray
    logits: jnp.ndarray
    candidates: jnp.ndarray | None = None
    q: jnp.ndarray | None = None


def propose_fn(params: Params, state: DecodeState, static: Decoding):
    """Drafts ``static.depth`` tokens per row (pure; the state is read only).

    ``static.draft_mode`` ``"argmax"`` proposes the drafter's argmax (a DFlash2 drafter: its
    selector's greedy path); ``"sample"`` draws each draft from the drafter's distribution warped
    by the row's sampling settings (``state.sampling``; a greedy row's draft is the argmax; a
    DFlash2 drafter draws from its selector's ``q``), with the uniform of the draft's position, the
    uniform the target's token there is drawn with (:mod:`dflash_jax.decode.sampling`: the two are
    coupled, what is committed does not change).

    Returns:
      ``(drafts [B, n] int32 target ids, conf [B, n] float32)``: ``conf`` is the top probability
      of the drafter's (unwarped) distribution at each position, a function of the distribution
      only, never of a sampled draft (:mod:`dflash_jax.decode.auto.policy` chooses the verify
      width from it). :func:`proposal_fn` gives the whole :class:`Proposal`.
    """
    p = proposal_fn(params, state, static)
    return p.drafts, p.conf


def proposal_fn(params: Params, state: DecodeState, static: Decoding) -> Proposal:
    """:func:`propose_fn`'s :class:`Proposal` (with the logits and a selector's ``q``)."""
    cfg_t, cfg_d = static.target, static.drafter
    params_d = params.drafter
    lg, positions, hidden, anchor = draft_pass(params, state, static)
    conf = top_confidence(lg)
    sampled = static.draft_mode != "argmax"
    if drafter.has_selector(cfg_d):
        x = drafter.selector_inputs(params_d, cfg_d, hidden, lg)
        t, u = (state.sampling.temperature, uniform_at(state.rng, positions[:, 1:])) if sampled else (None, None)
        path, q = drafter.select(params_d, cfg_d, x, anchor, t, u)
        return Proposal(path, conf, lg, x.candidates, q)
    if not sampled:
        return Proposal(drafter.draft_token_ids(params_d, cfg_d, jnp.argmax(lg, axis=-1)), conf, lg)
    ids = params_d["draft_ids"] if cfg_d.draft_vocab_size else None  # the target ids of the columns of lg
    # the mask at position p drafts the token at index p: the target draws that token with the same uniform
    return Proposal(sample_at(state.rng, positions[:, 1:], lg, state.sampling, vocab=cfg_t.vocab_size, ids=ids), conf, lg)


def top_confidence(logits: jnp.ndarray) -> jnp.ndarray:
    """The top probability ``[B, n]`` float32 of the drafter's logits ``[B, n, V']`` at each slot."""
    return 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)


def draft_logits(params: Params, state: DecodeState, static: Decoding):
    """The drafter's one pass over each row's block ``[anchor, MASK x (width - 1)]`` (pure).

    Returns:
      ``(logits [B, width - 1, V'] float32, positions [B, width] int32)``: the drafter's logits at
      each mask slot (``V'``: its draft vocabulary when it has one, else the target's) and the
      block's positions (:func:`block_positions`).
    """
    return draft_pass(params, state, static)[:2]


def draft_pass(params: Params, state: DecodeState, static: Decoding):
    """:func:`draft_logits` and what a selector also reads: ``(logits, positions, hidden
    [B, width - 1, H] the final-normed hidden states of the mask slots, anchor [B] int32)``."""
    cfg_t, cfg_d, width = static.target, static.drafter, static.width
    params_d = params.drafter
    start, positions, block_len = block_positions(state, width)
    anchor = jnp.take_along_axis(state.tokens, start[:, None], axis=1)
    block = jnp.concatenate([anchor, jnp.full((anchor.shape[0], width - 1), cfg_d.mask_token_id, jnp.int32)], axis=1)
    ctx = state.speculative
    hidden = drafter.forward(params_d, cfg_d, module_for(cfg_t), params.target, cfg_t, block, positions, ctx.ctx_k, ctx.ctx_v, start, block_len,
                             pages=ctx.context.pages)[:, 1:]
    return drafter.logits(params_d, cfg_d, module_for(cfg_t), params.target, cfg_t, hidden), positions, hidden, anchor[:, 0]


@functools.partial(jax.jit, static_argnames=("static",))
def propose_block(params: Params, state: DecodeState, static: Decoding):
    """Jitted :func:`propose_fn`: ``(drafts [B, n] int32, conf [B, n] float32)``.
    Raises DFlashError for arguments that do not go together
    (:func:`~dflash_jax.decode.state.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    params = params.trees()
    return propose_fn(params, state, static)


def accept(drafts: jnp.ndarray, chosen: jnp.ndarray, n_valid: jnp.ndarray):
    """The accept rule (module docstring).

    Args:
      drafts: ``[B, n]`` int32.
      chosen: ``[B, n + 1]`` int32 the target's token at each slot of ``[anchor, drafts]`` (the
        token that follows that slot).
      n_valid: ``[B]`` int32 drafts that may be accepted (shorter final block).
    Returns:
      ``(a [B] int32 accepted drafts, bonus [B] int32)``.
    """
    ok = (drafts == chosen[:, :-1]) & (jnp.arange(drafts.shape[1])[None, :] < n_valid[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    return a, jnp.take_along_axis(chosen, a[:, None], axis=1)[:, 0]


class Verdict(NamedTuple):
    """What the target said about one block, for :func:`dflash_jax.decode.step.commit_block`.

    Attributes:
      tokens: ``[B, n + 1]`` int32: the ``accepted`` leading drafts, then the bonus token.
      accepted: ``[B]`` int32 drafts accepted.
      n_valid: ``[B]`` int32 drafts that could be accepted (shorter final block).
      gaps: ``[B, n + 1]`` float32 top-2 logit gaps of the target at each block slot.
      cache: the target cache with the block's K/V written.
      capture: the block's captured target features (base = the anchor's position).
      logprobs: under ``Decoding(logprobs=k)`` the target's log-probabilities of ``tokens``
        (:class:`~dflash_jax.decode.logprobs.TokenLogprobs`, ``[B, n + 1]`` slots), else ``None``.
    """

    tokens: jnp.ndarray
    accepted: jnp.ndarray
    n_valid: jnp.ndarray
    gaps: jnp.ndarray
    cache: object
    capture: Capture
    logprobs: object = None


def verify_fn(params: Params, state: DecodeState, static: Decoding, drafts, draft_logits=None, capture: Capture | None = None) -> Verdict:
    """One target pass over ``[anchor, drafts]`` of each row, then the accept rule (module docstring).

    Args:
      drafts: ``[B, n]`` int32 from propose (``n = 0``: the anchor alone, a plain step that
        keeps the drafter context).
      draft_logits: under ``draft_mode="reject"`` the drafter's logits ``[B, n, V']`` the drafts
        were drawn from (:attr:`Proposal.logits`), else unused.
      capture: the buffer the block's target features are written into (``None``: a fresh one of
        the block's width based at the anchor, :func:`block_capture`).
    Returns:
      :class:`Verdict` (the state is read only).
    """
    cfg_t = static.target
    mod = module_for(cfg_t)
    width = drafts.shape[1] + 1
    start, positions, block_len = block_positions(state, width)
    anchor = jnp.take_along_axis(state.tokens, start[:, None], axis=1)
    block = jnp.concatenate([anchor, drafts], axis=1)
    capture = block_capture(static, start, width) if capture is None else capture
    # a family with recurrent state (families/qwen3_5/model.py) keeps each block position's state for
    # the commit to choose from; a KV-only family has none (its rollback is the length update)
    cache = mod.keep_block_states(cfg_t, state.cache) if mod.recurrent_state else state.cache
    hidden, cache, capture = mod.forward_hidden(params.target, cfg_t, block, positions, cache, capture)
    logits = mod.lm_head(params.target, cfg_t, hidden)
    n_valid = block_len - 1
    if static.draft_mode == "reject":
        q = draft_probabilities(params, static, state, draft_logits)
        a, bonus = reject_rule(state.rng, positions, logits, q, drafts, n_valid, state.sampling)
    else:
        a, bonus = accept(drafts, sample_at(state.rng, positions + 1, logits, state.sampling), n_valid)
    k = jnp.arange(width, dtype=jnp.int32)[None, :]
    drafts_pad = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(k < a[:, None], drafts_pad, bonus[:, None])
    lp = None if static.logprobs is None else token_logprobs.of_logits(logits, tokens, static.logprobs)
    return Verdict(tokens=tokens, accepted=a, n_valid=n_valid, gaps=top2_gap(logits), cache=cache, capture=capture, logprobs=lp)


def draft_probabilities(params: Params, static: Decoding, state: DecodeState, draft_logits) -> jnp.ndarray:
    """The drafter's sampling distribution ``q [B, n, V]`` float32 over the target's vocabulary:
    its logits ``[B, n, V']`` warped by each row's settings (the distribution a ``"sample"`` draft
    is drawn from; one-hot at the argmax for a greedy row), a draft vocabulary's columns laid out
    at their target ids.

    Raises:
      DFlashError: no logits (``verify_fn`` under ``draft_mode="reject"`` needs them).
    """
    if draft_logits is None:
        raise DFlashError("draft_logits", "None under draft_mode='reject'", "the drafter's logits (Proposal.logits) the drafts were drawn from")
    q = probabilities(draft_logits, state.sampling)
    if static.drafter.draft_vocab_size:
        q = jnp.zeros(q.shape[:-1] + (static.target.vocab_size,), q.dtype).at[..., params.drafter["draft_ids"]].set(q)
    return q


def reject_rule(rng, positions, logits, q, drafts, n_valid, sampling):
    """The standard rejection rule (Leviathan et al. 2023; Chen et al. 2023) over a chain.

    Draft ``i`` (drawn from ``q_i``; a DFlash drafter's slots do not depend on the drafts before
    them, so each is a draw of ``q_i`` whatever was accepted) is accepted with probability
    ``min(1, p_i(d_i) / q_i(d_i))``, ``p_i`` the target's warped distribution at its slot; at the
    first rejection the bonus token is drawn from the residual ``max(0, p_i - q_i)`` normalized,
    after ``n_valid`` accepted drafts it is the target's own draw at the next slot. Every committed
    token then follows the target's distribution (the tests' chi-square), and a draft is accepted
    with probability ``sum_x min(p_i(x), q_i(x))``, the most any rule can reach for a draft drawn
    from ``q_i``. The accept test and the residual draw read the uniforms of the draft's position
    in streams 1 and 2 (:func:`~dflash_jax.decode.sampling.uniform_at`). A greedy row (one-hot
    ``p`` and ``q``) accepts while the draft is the target's argmax, its bonus the argmax.

    Args:
      rng: ``[B]`` keys; positions: ``[B, n + 1]`` int32 the block's positions (anchor first).
      logits: ``[B, n + 1, V]`` the target's; q: ``[B, n, V]`` float32 the drafter's distributions.
      drafts: ``[B, n]`` int32; n_valid: ``[B]`` int32; sampling: the rows' settings.
    Returns:
      ``(a [B] int32 accepted drafts, bonus [B] int32)``, as :func:`accept`.
    """
    n = drafts.shape[1]
    p = probabilities(logits, sampling)
    pd = jnp.take_along_axis(p[:, :n], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    index = positions[:, 1:]
    ok = (uniform_at(rng, index, 1) * qd < pd) & (jnp.arange(n)[None, :] < n_valid[:, None])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    residual = jnp.maximum(p[:, :n] - q, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p[:, :n])  # p == q: never rejected
    fixed = jnp.concatenate([inverse_cdf(residual, uniform_at(rng, index, 2)), jnp.zeros_like(a)[:, None]], axis=1)
    own = sample_at(rng, positions + 1, logits, sampling)
    bonus = jnp.where(a < n_valid, jnp.take_along_axis(fixed, a[:, None], axis=1)[:, 0], jnp.take_along_axis(own, a[:, None], axis=1)[:, 0])
    return a, bonus


def commit_block(params: Params, state: DecodeState, static: Decoding, verdict: Verdict, absorb: bool = True) -> DecodeState:
    """Commits each running row's accepted drafts and bonus token (``accepted + 1`` tokens, cut at
    stop ids, budget and capacity by :func:`dflash_jax.decode.state.commit`), projects the block's
    captured rows into the drafter context (not with ``absorb`` false: the caller keeps
    ``verdict.capture``) and counts statistics for running rows and kept tokens only. Counts one
    target pass (``steps``)."""
    running = ~state.done
    before = state.length
    state = commit(state.replace(cache=verdict.cache), verdict.tokens, verdict.accepted + 1, verdict.gaps, verdict.logprobs)
    kept = state.length - before
    mod = module_for(static.target)
    if mod.recurrent_state:  # the recurrent states after the kept positions (verify_block kept them all)
        state = state.replace(cache=mod.commit_block_states(static.target, state.cache, kept))
    ctx = absorb_context(params.drafter, static, state.speculative, verdict.capture) if absorb else state.speculative
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


def verify_commit(params: Params, state: DecodeState, static: Decoding, drafts, draft_logits=None) -> DecodeState:
    """Verifies all of ``drafts [B, n]`` and commits, counting the step at width ``n``
    (``draft_logits``: as :func:`verify_fn`)."""
    state = commit_block(params, state, static, verify_fn(params, state, static, drafts, draft_logits))
    return state.replace(speculative=count_width(state.speculative, drafts.shape[1], jnp.bool_(False)))


@functools.partial(jax.jit, static_argnames=("static",), donate_argnames=("state",))
def verify_block(params: Params, state: DecodeState, static: Decoding, drafts) -> DecodeState:
    """Jitted verify and commit of given ``drafts [B, n]`` int32, state donated: the new state.
    Raises DFlashError for arguments that do not go together
    (:func:`~dflash_jax.decode.state.check_step_inputs`)."""
    check_step_inputs(params, state, static)
    params = params.trees()
    return verify_commit(params, state, static, drafts)
