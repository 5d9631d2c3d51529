"""The DFlash training objective as pure functions (``docs/specs/dflash.md`` sections 3.3-3.6).

One training example is a token sequence ``x [S]`` with a ``loss_mask [S]`` (1 on response tokens)
and the captured target features ``f [S, K*H]`` of every position (the residual after each
``target_layer_ids`` layer, concatenated; section 3.2). Per sequence:

* ``N`` anchor positions are drawn uniformly without replacement among the valid ones
  (``loss_mask[a] = loss_mask[a + 1] = 1``, section 3.3, current SpecForge rule), then sorted;
  sequences with fewer valid positions keep them all and mark the rest as invalid blocks;
* block ``j`` is ``[x[a_j], MASK, ..., MASK]`` (``block_size`` tokens) at positions
  ``a_j + 0 .. a_j + B - 1`` (section 3.4);
* it attends the drafter context K/V of positions strictly before its anchor (``< a_j``) and its
  own block slots (bidirectionally, or causally / windowed where a drafter layer is; section 3.5);
  blocks never see each other: each block is a separate :func:`dflash_jax.drafter.generic.forward`
  pass (``jax.vmap`` over blocks) over one shared context K/V computed once per sequence with
  :func:`dflash_jax.drafter.model.context_kv`, with ``ctx_len = a_j``. This is the inference
  code path itself, so training and inference masks cannot diverge;
* slot ``k`` (``k = 1 .. B-1``) predicts ``x[a_j + k]`` (same-position labels; slot 0 has no
  loss), weighted by ``exp(-(k - 1) / gamma) * loss_mask[a_j + k] * (a_j + k < S)`` (section 3.6);
  with ``labels`` given, it predicts ``labels[a_j + k]`` instead (the target's greedy next token
  after ``x[: a_j + k]``, for text the target did not write: ``Batcher(labels="target")``).

The loss is ``sum(w * CE) / sum(w)`` over all blocks of the batch. The target's embedding and LM
head enter only through ``target_params`` and are never differentiated (callers take gradients
with respect to the drafter parameters only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.drafter import model as drafter
from dflash_jax.families.registry import module_for


def valid_anchors(loss_mask: jnp.ndarray) -> jnp.ndarray:
    """Positions that may anchor a training block.

    Args:
      loss_mask: ``[B, S]`` (bool, int or float; nonzero = supervised response token). Padding
        must carry 0.
    Returns:
      ``[B, S]`` bool: ``loss_mask[a] and loss_mask[a + 1]`` (the last position is never valid).
      Source: ``docs/specs/dflash.md`` 3.3 (SpecForge's current rule).
    """
    m = loss_mask > 0
    nxt = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    return m & nxt


def sample_anchors(key: jax.Array, loss_mask: jnp.ndarray, num_anchors: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Draws ``num_anchors`` distinct anchors per sequence uniformly among the valid positions.

    Args:
      key: PRNG key.
      loss_mask: ``[B, S]`` (see :func:`valid_anchors`).
      num_anchors: ``N`` blocks per sequence (static); clipped to ``S``.
    Returns:
      ``(anchors [B, N] int32, block_valid [B, N] bool)``: valid anchors come first in increasing
      order; when a sequence has fewer than ``N`` valid positions the remaining blocks are
      invalid (``block_valid = False``, anchor 0, no loss). Source: ``docs/specs/dflash.md`` 3.3.
    """
    b, s = loss_mask.shape
    n = min(int(num_anchors), s)
    valid = valid_anchors(loss_mask)
    score = jnp.where(valid, jax.random.uniform(key, (b, s)), -1.0)
    top, idx = jax.lax.top_k(score, n)  # the n largest uniform scores = uniform sample w/o replacement
    ok = top >= 0.0
    order = jnp.argsort(jnp.where(ok, idx, s + idx), axis=1)
    anchors = jnp.take_along_axis(jnp.where(ok, idx, 0), order, axis=1).astype(jnp.int32)
    return anchors, jnp.take_along_axis(ok, order, axis=1)


def block_inputs(tokens: jnp.ndarray, anchors: jnp.ndarray, block_size: int, mask_token_id: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Draft inputs of every block (``docs/specs/dflash.md`` 3.4).

    Args:
      tokens: ``[B, S]`` int32.
      anchors: ``[B, N]`` int32.
    Returns:
      ``(block_tokens [B, N, W] int32 = [x[a], MASK, ...], positions [B, N, W] int32 = a + 0..W-1)``
      with ``W = block_size``.
    """
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)
    w = int(block_size)
    blk = jnp.concatenate([anchor_tok[..., None], jnp.full(anchors.shape + (w - 1,), mask_token_id, jnp.int32)], axis=-1)
    pos = anchors[..., None] + jnp.arange(w, dtype=jnp.int32)
    return blk.astype(jnp.int32), pos


def position_weights(block_size: int, gamma: float) -> jnp.ndarray:
    """``[W]`` float32 slot weights ``exp(-(k - 1) / gamma)`` for ``k >= 1`` and 0 for the anchor
    slot (paper Eq. 4, ``docs/specs/dflash.md`` 3.6). ``gamma <= 0`` disables the decay (all 1)."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    w = jnp.exp(-(k - 1.0) / gamma) if gamma > 0 else jnp.ones_like(k)
    return jnp.where(k > 0, w, 0.0)


def block_targets(tokens, loss_mask, anchors, block_valid, block_size: int, gamma: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Labels and loss weights of every block slot (``docs/specs/dflash.md`` 3.4 and 3.6).

    Args:
      tokens: ``[B, S]`` int32; loss_mask: ``[B, S]``; anchors, block_valid: ``[B, N]``.
    Returns:
      ``(labels [B, N, W] int32, weights [B, N, W] float32)``: slot ``k`` is labelled with the
      token at its own position ``a + k`` (0 past the end); its weight is
      ``block_valid * (k > 0) * (a + k < S) * loss_mask[a + k] * exp(-(k - 1) / gamma)``.
    """
    s = tokens.shape[1]
    pos = anchors[..., None] + jnp.arange(block_size, dtype=jnp.int32)
    inside = pos < s
    flat = jnp.where(inside, pos, 0).reshape(pos.shape[0], -1)
    labels = jnp.take_along_axis(tokens, flat, axis=1).reshape(pos.shape)
    m = jnp.take_along_axis((loss_mask > 0).astype(jnp.float32), flat, axis=1).reshape(pos.shape)
    w = position_weights(block_size, gamma) * m * inside * block_valid[..., None]
    return jnp.where(inside, labels, 0).astype(jnp.int32), w.astype(jnp.float32)


def block_hidden(params, cfg: DrafterConfig, target_params, target_cfg: TargetConfig, features, block_tokens, positions, anchors):
    """Drafter outputs of every block, each seeing only context positions ``< anchor``.

    Args:
      features: ``[B, S, K*H]`` captured target features (slot = position).
      block_tokens, positions: ``[B, N, W]`` from :func:`block_inputs`.
      anchors: ``[B, N]`` int32 (the context length of each block).
    Returns:
      ``[B, N, W, H]`` final-normed drafter hidden states in ``cfg.dtype``.
    """
    b, s = features.shape[:2]
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    ck, cv = drafter.context_kv(params, cfg, features, ctx_pos)

    def one(blk, pos, ctx_len):
        return drafter.forward(params, cfg, module_for(target_cfg), target_params, target_cfg, blk, pos, ck, cv, ctx_len, live_context=False)

    return jax.vmap(one, in_axes=(1, 1, 1), out_axes=1)(block_tokens, positions, anchors)


def loss_terms(
    params,
    cfg: DrafterConfig,
    target_params,
    target_cfg: TargetConfig,
    tokens: jnp.ndarray,
    loss_mask: jnp.ndarray,
    features: jnp.ndarray,
    anchors: jnp.ndarray,
    block_valid: jnp.ndarray,
    gamma: float,
    draft_ids: jnp.ndarray | None = None,
    labels: jnp.ndarray | None = None,
) -> dict:
    """Per-block sums of the weighted cross-entropy (no normalisation; pure, differentiable).

    Args:
      params: drafter parameters (``cfg.dtype`` is the compute dtype).
      target_params: the frozen target (only ``embed`` and the LM head are read).
      tokens: ``[B, S]`` int32; loss_mask: ``[B, S]`` (0 on prompt and padding);
      features: ``[B, S, K*H]`` captured target features; anchors, block_valid: ``[B, N]``.
      gamma: position-decay constant (``docs/specs/dflash.md`` 3.6; 7 for block size 16).
      draft_ids: optional ``[Vd]`` sorted token ids (:mod:`dflash_jax.drafter.vocab`): the softmax
        runs over these columns of the target head only; a label outside them gets no
        cross-entropy weight and counts as a miss for ``correct`` and ``accept``.
      labels: optional ``[B, S]`` int32 token each position is labelled with (default
        ``tokens``: same-position labels; :class:`dflash_jax.train.data.Batcher` gives the
        target's greedy next tokens with ``labels="target"``).
    Returns:
      dict of float32 arrays: ``ce [B, N]`` (sum of ``w * CE`` per block), ``weight [B, N]``
      (sum of ``w``), ``correct [B, N]`` (sum of ``w * [argmax == label]``), ``accept [B, N]``
      (leading slots whose argmax matches, counting only slots that exist and are supervised:
      the greedy acceptance length the block would get), ``slots [B, N, W-1]`` per-slot CE.
    """
    w = cfg.block_size
    blk, pos = block_inputs(tokens, anchors, w, cfg.mask_token_id)
    labels, weights = block_targets(tokens if labels is None else labels, loss_mask, anchors, block_valid, w, gamma)
    hidden = block_hidden(params, cfg, target_params, target_cfg, features.astype(cfg.dtype), blk, pos, anchors)
    lab, wt = labels[:, :, 1:], weights[:, :, 1:]  # slot 0 never has a loss
    if draft_ids is None:
        lg = drafter.logits(params, cfg, module_for(target_cfg), target_params, target_cfg, hidden[:, :, 1:])
        ce_wt = wt
    else:
        head = jax.lax.stop_gradient(draft_vocab.head_columns(target_params, draft_ids))
        lg = drafter.head_logits(cfg, module_for(target_cfg), target_cfg, hidden[:, :, 1:], head)
        to_draft = jnp.full((cfg.vocab_size,), -1, jnp.int32).at[draft_ids].set(jnp.arange(draft_ids.shape[0], dtype=jnp.int32))
        lab = to_draft[lab]  # -1: not in the draft vocabulary
        ce_wt = jnp.where(lab >= 0, wt, 0.0)
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, jnp.maximum(lab, 0)[..., None], axis=-1)[..., 0]
    ce = lse - picked
    hit = (jnp.argmax(lg, axis=-1) == lab) & (wt > 0)
    return {
        "ce": jnp.sum(ce_wt * ce, axis=-1),
        "weight": jnp.sum(ce_wt, axis=-1),
        "correct": jnp.sum(wt * hit, axis=-1),
        "accept": jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1).astype(jnp.float32),
        "slots": ce,
    }


def dflash_loss(params, cfg, target_params, target_cfg, tokens, loss_mask, features, anchors, block_valid, gamma: float, draft_ids=None,
                labels=None):
    """The DFlash loss ``sum(w * CE) / sum(w)`` over the batch and scalar metrics.

    Args: as :func:`loss_terms`.
    Returns:
      ``(loss, metrics)``: ``loss`` float32 scalar (0 when no slot is supervised); metrics
      ``ce_sum``, ``weight_sum``, ``acc`` (weighted argmax accuracy), ``accept_len`` (mean
      greedy acceptance length of the valid blocks, bonus token excluded), ``blocks``.
    """
    t = loss_terms(params, cfg, target_params, target_cfg, tokens, loss_mask, features, anchors, block_valid, gamma, draft_ids, labels)
    ce, wsum = jnp.sum(t["ce"]), jnp.sum(t["weight"])
    denom = jnp.maximum(wsum, 1e-9)
    nblk = jnp.sum(block_valid)
    metrics = {
        "ce_sum": ce,
        "weight_sum": wsum,
        "acc": jnp.sum(t["correct"]) / denom,
        "accept_len": jnp.sum(t["accept"] * block_valid) / jnp.maximum(nblk, 1),
        "blocks": nblk.astype(jnp.float32),
    }
    return ce / denom, metrics
