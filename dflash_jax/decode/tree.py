"""Tree verification: the drafter's top candidates at each slot as a tree, verified in one target pass.

A DFlash drafter predicts every slot of its block in one pass, and slot ``d``'s distribution does
not depend on the token chosen at an earlier slot, so a candidate continuation is a path through
the per-slot top-k lists. :func:`build_tree` grows a best-first tree of ``static.tree`` nodes below
the anchor: at every step it adds the frontier candidate (the next-ranked child of a node) whose
path has the highest product of the drafter's probabilities (SpecInfer, Miao et al. 2024; the
dynamic trees of EAGLE-2, Li et al. 2024). Parents come before children, siblings are distinct
tokens, at most ``static.depth`` deep.

The target verifies ``[anchor, nodes]`` in one pass (:class:`~dflash_jax.nn.attention.TreeBlock`:
node ``i`` sits at slot ``start + i``, at RoPE position ``start + depth``, and sees the committed
context and its own ancestors). The accept rule is the chain's ("sample and match",
:mod:`dflash_jax.decode.step`): the target chooses its token at every node with the
uniform of that node's position, and the accepted path follows, from the anchor, the child equal
to the target's token. Every committed token is still the target's own choice with the row's key,
so greedy output equals plain greedy decoding and sampled output is exactly the target's sample,
for every tree shape. The accepted path's K/V rows and captured features are then moved to the
slots a chain would have used (``start + depth``), so commit, rollback, the drafter context and
the statistics are the chain's.
"""

from __future__ import annotations

from typing import NamedTuple
import jax
import jax.numpy as jnp
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.drafter import model as drafter
from dflash_jax.nn.attention import TreeBlock
from dflash_jax.families.registry import module_for
from dflash_jax.decode import logprobs as token_logprobs
from dflash_jax.decode.sampling import sample_at, top2_gap
from dflash_jax.decode.step import block_capture
from dflash_jax.decode.step import block_positions, draft_pass, top_confidence
from dflash_jax.decode.step import Verdict
from dflash_jax.decode.state import DecodeState


class DraftTree(NamedTuple):
    """A tree of ``N`` drafted nodes below each row's anchor (block index 0; node ``i`` is block
    index ``i + 1``).

    Attributes:
      tokens: ``[B, N]`` int32 target token ids.
      parent: ``[B, N]`` int32 block index of each node's parent (0: the anchor).
      depth: ``[B, N]`` int32 depth below the anchor (1: the first draft slot).
      alive: ``[B, N]`` bool nodes that were drafted (False only when the lists ran out).
      mask: ``[B, N + 1, N + 1]`` bool over the block: ``mask[b, i, j]``, ``j`` is ``i`` or an
        ancestor of ``i``.
      prob: ``[B, N]`` float32 the drafter's probability of each node's token at its slot
        (``None`` for a scripted tree; ``n_max="auto"`` reads it).
      rank: ``[B, N]`` int32 each node's rank among its slot's candidates (0: the top one).
    """

    tokens: jnp.ndarray
    parent: jnp.ndarray
    depth: jnp.ndarray
    alive: jnp.ndarray
    mask: jnp.ndarray
    prob: jnp.ndarray | None = None
    rank: jnp.ndarray | None = None

    def first(self, w: int) -> "DraftTree":
        """The tree of its first ``w`` nodes (static): parents come before children, so it is a
        tree, and a best-first tree's first ``w`` nodes are the best tree of ``w`` nodes."""
        cut = lambda x: None if x is None else x[:, :w]  # noqa: E731
        return DraftTree(tokens=self.tokens[:, :w], parent=self.parent[:, :w], depth=self.depth[:, :w], alive=self.alive[:, :w],
                         mask=self.mask[:, : w + 1, : w + 1], prob=cut(self.prob), rank=cut(self.rank))

    def block(self) -> TreeBlock:
        """The target's view of ``[anchor, nodes]``: depths ``[B, N + 1]`` and the ancestor mask."""
        return TreeBlock(depth=jnp.pad(self.depth, ((0, 0), (1, 0))), mask=self.mask)


def build_tree(logits: jnp.ndarray, nodes: int, children_of=None, anchor: jnp.ndarray | None = None) -> tuple[jnp.ndarray, DraftTree]:
    """The best-first tree of ``nodes`` candidates over per-slot drafter logits (module docstring).

    Args:
      logits: ``[B, n, V']`` float32 the drafter's logits at its ``n`` draft slots.
      nodes: static node budget ``N`` (the anchor not counted).
      children_of: ``(slot [B] int32, token [B] int32) -> (lp [B, k], ix [B, k])``: the ranked
        children (log-probabilities best first, their ids) of a node holding ``token`` whose children
        sit at draft slot ``slot``; ``None``: the drafter's own top ``min(N, V')`` per slot, the same
        for every node of a slot (a DFlash2 selector ranks each node's children after its token:
        :func:`tree_of`).
      anchor: ``[B]`` int32 the root's token (read by ``children_of`` only).
    Returns:
      ``(index [B, N] int32, tree)``: each node's id as ``children_of`` gives it (without it, its
      column of ``logits``: its draft-vocabulary id; ``tree.tokens`` is left zero for the caller to
      map) and the :class:`DraftTree`.
    """
    b, n, v = logits.shape
    rows = jnp.arange(b)
    if children_of is None:
        top_lp, top_ix = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), min(nodes, v))  # [B, n, k]
        children_of = lambda slot, tok: (top_lp[rows, slot], top_ix[rows, slot])  # noqa: E731
    m = nodes + 1
    lp0, ix0 = children_of(jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32) if anchor is None else anchor)
    k = lp0.shape[-1]
    child_lp = jnp.zeros((b, m, k), jnp.float32).at[:, 0].set(lp0)  # each node's ranked children
    child_ix = jnp.zeros((b, m, k), jnp.int32).at[:, 0].set(ix0)
    depth = jnp.zeros((b, m), jnp.int32)
    score = jnp.zeros((b, m), jnp.float32)
    children = jnp.zeros((b, m), jnp.int32)
    alive = jnp.zeros((b, m), bool).at[:, 0].set(True)
    parent = jnp.zeros((b, m), jnp.int32)
    index = jnp.zeros((b, m), jnp.int32)
    rank = jnp.zeros((b, m), jnp.int32)
    prob = jnp.zeros((b, m), jnp.float32)
    mask = jnp.zeros((b, m, m), bool).at[:, 0, 0].set(True)
    for s in range(1, m):  # N small static steps; each adds the best frontier child
        open_ = alive & (depth < n) & (children < k)
        r = jnp.minimum(children, k - 1)
        lp_next = jnp.take_along_axis(child_lp, r[:, :, None], axis=2)[:, :, 0]  # [B, m] each node's next child
        cand = jnp.where(open_, score + lp_next, -jnp.inf)
        u = jnp.argmax(cand, axis=1)
        ok = jnp.isfinite(cand[rows, u])
        ru = r[rows, u]
        tok = child_ix[rows, u, ru]
        du = depth[rows, u] + 1
        depth = depth.at[:, s].set(du)
        score = score.at[:, s].set(cand[rows, u])
        parent = parent.at[:, s].set(u.astype(jnp.int32))
        index = index.at[:, s].set(tok)
        rank = rank.at[:, s].set(ru)
        prob = prob.at[:, s].set(jnp.exp(child_lp[rows, u, ru]))
        alive = alive.at[:, s].set(ok)
        children = children.at[rows, u].add(ok.astype(jnp.int32))
        mask = mask.at[:, s].set(mask[rows, u] | (jnp.arange(m) == s)[None, :])
        if s < m - 1:  # the new node's own ranked children (at the slot after its own; unused at depth n)
            lp_s, ix_s = children_of(jnp.minimum(du, n - 1), tok)
            child_lp, child_ix = child_lp.at[:, s].set(lp_s), child_ix.at[:, s].set(ix_s)
    tree = DraftTree(tokens=jnp.zeros((b, nodes), jnp.int32), parent=parent[:, 1:], depth=depth[:, 1:],
                     alive=alive[:, 1:], mask=mask, prob=prob[:, 1:], rank=rank[:, 1:])
    return index[:, 1:], tree


def accept_tree(tree: DraftTree, chosen: jnp.ndarray, valid: jnp.ndarray, n: int):
    """The accept rule over a tree (module docstring).

    Args:
      tree: the verified :class:`DraftTree` of ``N`` nodes.
      chosen: ``[B, N + 1]`` int32 the target's token at each block slot (the token after it).
      valid: ``[B, N]`` bool nodes that may be accepted.
      n: static deepest depth (the drafted slots).
    Returns:
      ``(a [B] int32 accepted depth, path [B, n + 1] int32)``: ``path[b, d]`` is the block index
      of the accepted node at depth ``d`` for ``d <= a`` (``path[:, 0] = 0``, the anchor), and
      ``d`` beyond (rows that stay where they are).
    """
    parent_tok = jnp.take_along_axis(chosen, tree.parent, axis=1)
    match = valid & (tree.tokens == parent_tok)  # [B, N]
    on_path = jnp.all(match[:, None, :] | ~tree.mask[:, 1:, 1:], axis=2)  # every ancestor matches
    ok = jnp.pad(on_path, ((0, 0), (1, 0)), constant_values=True)  # [B, N + 1]
    depth = jnp.pad(tree.depth, ((0, 0), (1, 0)))
    a = jnp.max(jnp.where(ok, depth, 0), axis=1).astype(jnp.int32)
    d = jnp.arange(n + 1, dtype=jnp.int32)
    idx = jnp.arange(depth.shape[1], dtype=jnp.int32)
    hit = ok[:, None, :] & (depth[:, None, :] == d[None, :, None])  # [B, n + 1, N + 1]
    path = jnp.sum(jnp.where(hit, idx[None, None, :], 0), axis=2)
    return a, jnp.where(d[None, :] <= a[:, None], path, d[None, :]).astype(jnp.int32)


def propose_tree_fn(params: Params, state: DecodeState, static: Decoding) -> tuple[DraftTree, jnp.ndarray]:
    """The drafter's pass over each row's block and the best-first tree of ``static.tree`` nodes
    over its ``static.depth`` slots (pure; the state is read only).

    Returns:
      ``(tree, conf)``: the :class:`DraftTree` of ``N = static.tree`` nodes per row, ``tokens`` in
      target ids (through the drafter's draft vocabulary when it has one), and ``conf [B, n]``
      float32 the top probability at each slot (as :func:`~dflash_jax.decode.step.propose_fn`
      reports it).
    """
    return tree_of(params, static, *tree_inputs(params, state, static))


def tree_inputs(params: Params, state: DecodeState, static: Decoding) -> tuple:
    """What :func:`tree_of` reads of the drafter's pass: ``(logits,)``, and for a DFlash2 drafter
    also the mask slots' hidden states and the anchors (its selector ranks the children)."""
    lg, _, hidden, anchor = draft_pass(params, state, static)
    return (lg, hidden, anchor) if drafter.has_selector(static.drafter) else (lg,)


def tree_of(params: Params, static: Decoding, logits: jnp.ndarray, hidden=None, anchor=None) -> tuple[DraftTree, jnp.ndarray]:
    """:func:`propose_tree_fn` after the drafter's pass, from :func:`tree_inputs` (the adaptive
    step's drafting branch runs both, :mod:`dflash_jax.decode.auto.adaptive`).

    A DFlash2 drafter's tree ranks each node's children by its selector's pairwise scores after the
    node's token (``log_softmax`` over the ``selector_top_k`` candidates of the next slot; the
    root's after the anchor), so the tree's first path is the selector's greedy path."""
    if hidden is not None:
        x = drafter.selector_inputs(params.drafter, static.drafter, hidden, logits)
        rows = jnp.arange(logits.shape[0])

        def children_of(slot, tok):
            lp = jax.nn.log_softmax(drafter.selector_scores(params.drafter, x, slot, tok), axis=-1)
            lp, order = jax.lax.top_k(lp, lp.shape[-1])
            return lp, jnp.take_along_axis(x.candidates[rows, slot], order, axis=-1)

        tokens, tree = build_tree(logits, static.tree, children_of, anchor)
        return tree._replace(tokens=tokens), top_confidence(logits)
    index, tree = build_tree(logits, static.tree)
    return tree._replace(tokens=drafter.draft_token_ids(params.drafter, static.drafter, index)), top_confidence(logits)


def verify_tree_fn(params: Params, state: DecodeState, static: Decoding, tree: DraftTree) -> Verdict:
    """One target pass over ``[anchor, nodes]`` of each row, the accept rule, and the accepted
    path moved to the chain's slots (module docstring; the state is read only).

    Returns:
      :class:`~dflash_jax.decode.step.Verdict` as a chain's verify gives it: ``tokens``,
      ``gaps`` and ``capture`` along the accepted path (``[B, min(n, N) + 1]``), the cache compacted;
      ``n_valid`` counts the nodes that could be accepted.
    """
    cfg_t, n = static.target, static.depth
    mod = module_for(cfg_t)
    nodes = tree.tokens.shape[1]
    start, _, block_len = block_positions(state, n + 1)
    positions = start[:, None] + jnp.arange(nodes + 1, dtype=jnp.int32)[None, :]
    anchor = jnp.take_along_axis(state.tokens, start[:, None], axis=1)
    block = jnp.concatenate([anchor, tree.tokens], axis=1)
    blk = tree.block()
    capture = block_capture(static, start, nodes + 1)
    hidden, cache, capture = mod.forward_hidden(params.target, cfg_t, block, positions, state.cache, capture, tree=blk)
    logits = mod.lm_head(params.target, cfg_t, hidden)
    chosen = sample_at(state.rng, start[:, None] + blk.depth + 1, logits, state.sampling)
    valid = tree.alive & (tree.depth < block_len[:, None]) & (positions[:, 1:] < state.capacity)
    deepest = min(n, nodes)  # no path is longer; the capture holds nodes + 1 rows
    a, path = accept_tree(tree, chosen, valid, deepest)
    dst = start[:, None] + jnp.arange(deepest + 1, dtype=jnp.int32)[None, :]
    cache = mod.move_rows(cfg_t, cache, start[:, None] + path, dst)
    capture = capture.replace(hidden=jnp.take_along_axis(capture.hidden, path[:, :, None], axis=1))
    tokens = jnp.take_along_axis(chosen, path, axis=1)
    lp = None if static.logprobs is None else token_logprobs.of_logits(token_logprobs.along(logits, path), tokens, static.logprobs)
    return Verdict(tokens=tokens, accepted=a, n_valid=jnp.sum(valid, axis=1).astype(jnp.int32),
                   gaps=jnp.take_along_axis(top2_gap(logits), path, axis=1), cache=cache, capture=capture, logprobs=lp)
