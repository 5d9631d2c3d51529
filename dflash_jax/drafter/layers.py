"""The draft pass over one block, shared by the generic z-lab drafter and the Laguna drafter.

Both run the same pre-norm layer over ``[context K/V | block]``: q/k/v of the block with
per-head ``q_norm``/``k_norm`` and RoPE, attention of the block over the cached context plus
itself (per-layer masks from :func:`block_masks`), the optional softplus output gate
(``cfg.gate``, Laguna), ``o_proj`` (+ bias with ``attention_bias``) and a SwiGLU MLP. What
differs between the two (feature fusion and the context K/V input) lives in
:mod:`dflash_jax.drafter.generic` and :mod:`dflash_jax.drafter.laguna`.

Source: z-lab ``dflash/model.py`` (``Qwen3DFlashAttention``, ``DFlashDraftModel.forward``);
vLLM ``laguna_dflash.py`` (``docs/specs/laguna.md`` 6.4 (e)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.nn.layer import run_layers
from dflash_jax.nn.attention import cache_attention
from dflash_jax.nn.layer import attention_output, mlp_residual, project_qkv, split_heads
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.layer import apply_rope, inv_frequencies


def context_heads(cfg: DrafterConfig, k: jnp.ndarray, v: jnp.ndarray, k_norm: jnp.ndarray, positions: jnp.ndarray):
    """Every layer's context keys and values from their projections.

    Args:
      k, v: ``[Ld, B, T, Hkv*D]`` projected context (biases added).
      k_norm: ``[Ld, D]`` each layer's ``k_norm`` weight.
      positions: ``[B, T]`` int32 absolute positions of the context tokens.
    Returns:
      ``(k, v)`` each ``[Ld, B, T, Hkv, D]``: ``k`` per-head ``k_norm``-ed and rotated, ``v`` raw.
    """
    hkv, D = cfg.num_key_value_heads, cfg.head_dim
    k, v = split_heads(k, hkv, D), split_heads(v, hkv, D)
    k = rms_norm(k, k_norm[:, None, None, None, :], cfg.rms_norm_eps)
    inv_freq = inv_frequencies(cfg.rope, D)
    k = jax.vmap(lambda x: apply_rope(x, positions, inv_freq))(k)
    return k, v


def block_masks(cfg: DrafterConfig, positions, block_len):
    """Per-layer visibility masks of one block over its own slots.

    Args:
      positions: ``[B, W]`` int32 absolute block positions (slot 0 = anchor).
      block_len: ``[B]`` int32 block slots that exist (shorter final block, as z-lab's loop).
    Returns:
      ``[Ld, B, W, W]`` bool. Causal layers see block slots at or before their own; windowed
      layers see keys with ``|q - k| < window``.
    """
    causal = jnp.asarray(cfg.layer_causal, bool)[:, None, None, None]
    window = jnp.asarray(cfg.layer_window, jnp.int32)[:, None, None, None]
    qpos = positions[:, :, None]
    w = positions.shape[1]
    off = jnp.arange(w, dtype=jnp.int32)
    kpos = positions[:, None, :]
    blk = (off[None, None, :] < block_len[:, None, None])[None]
    blk = blk & (~causal | (off[None, None, None, :] <= off[None, None, :, None]))
    return blk & ((window == 0) | ((jnp.abs(qpos - kpos))[None] < window))


def context_visible(positions, ctx_len, window, slots):
    """``[B, W, K]`` mask of context ``slots [K]`` for block queries at ``positions [B, W]``:
    slots ``< ctx_len [B]`` (the committed context), and within ``window`` of the query when the
    layer's ``window`` (int32 scalar) is not 0 (context keys are always earlier)."""
    s = slots[None, None, :]
    qpos = positions[:, :, None]
    return (s < ctx_len[:, None, None]) & ((window == 0) | (qpos - s < window))


def forward(params_d: dict, cfg_d: DrafterConfig, embeds: jnp.ndarray, positions: jnp.ndarray,
            ctx_k: jnp.ndarray, ctx_v: jnp.ndarray, ctx_len: jnp.ndarray, block_len: jnp.ndarray | None = None,
            live_context: bool = True, pages=None) -> jnp.ndarray:
    """One draft pass over a block (contract of :func:`dflash_jax.drafter.layers.forward`).

    ``embeds [B, W, H]``: the block ``[anchor, MASK, ...]`` embedded by the target's family
    (:attr:`dflash_jax.families.contract.FamilyModel.embed`); it is multiplied by ``cfg_d.input_embedding_scale``;
    layers run stacked (one scan) or per layer (:func:`dflash_jax.nn.layer.run_layers`).
    Returns ``[B, W, H]`` final-normed hidden states in ``cfg_d.dtype``.
    """
    b, w = embeds.shape[:2]
    if block_len is None:
        block_len = jnp.full((b,), w, jnp.int32)
    D, hq, hkv, eps = cfg_d.head_dim, cfg_d.num_attention_heads, cfg_d.num_key_value_heads, cfg_d.rms_norm_eps
    inv_freq = inv_frequencies(cfg_d.rope, D)
    x = (embeds * cfg_d.input_embedding_scale).astype(cfg_d.dtype)
    capacity = ctx_k.shape[2] if pages is None else pages.capacity
    n_keys = jnp.clip(jnp.max(ctx_len), 1, capacity).astype(jnp.int32) if live_context else capacity

    def body(x, lp, layer_xs, i):
        bm, window = layer_xs
        h = rms_norm(x, lp["attn_norm"], eps)
        q, k, v = project_qkv(lp, h, hq, hkv, D, positions, inv_freq, eps, bias=cfg_d.attention_bias, qk_norm=True)
        visible = functools.partial(context_visible, positions, ctx_len, window)
        a = cache_attention(q, ctx_k, ctx_v, i, n_keys, visible, extra=((k, v, bm),), pages=pages)
        x = x + attention_output(lp, a, h, gate=cfg_d.gate, bias=cfg_d.attention_bias)
        return mlp_residual(lp, x, eps)

    xs = (block_masks(cfg_d, positions, block_len), jnp.asarray(cfg_d.layer_window, jnp.int32))
    x = run_layers(body, x, params_d["layers"], xs)
    return rms_norm(x, params_d["norm"], eps)
