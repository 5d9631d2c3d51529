"""The poolside Laguna decoder (XS.2, XS-2.1, S-2.1, M.1) as pure functions.

The family contract (:class:`dflash_jax.families.contract.FamilyModel`, :data:`MODEL`): it declares
``param_specs``, ``forward_hidden`` and its own cache (``init_cache``, ``move_rows``); the rest is derived.

Per layer (transformers ``modeling_laguna.py``, ``docs/specs/laguna.md`` section 3)::

    h = rms(x; attn_norm); q,k,v = h Wq, h Wk, h Wv; q,k = q_norm/k_norm per head, then RoPE
    (per layer type: YaRN with partial rotary on full layers, plain on sliding ones; the YaRN
    attention factor multiplies cos and sin once); GQA attention (causal; sliding layers see
    keys with q - k < sliding_window); a *= softplus(float32(h Wg)) per head or per element;
    x += a Wo; h2 = rms(x; mlp_norm); x += dense SwiGLU(h2) or MoE(h2).

MoE: float32 router logits (optional tanh soft-cap), sigmoid scores, top-k chosen on
``scores + e_score_correction_bias`` (the bias only picks experts), the chosen *unbiased* scores
renormalised, cast to the hidden dtype; only the chosen experts run (tokens sorted by expert and
``jax.lax.ragged_dot``); routed sum times ``routed_scaling_factor`` plus the always-on shared
expert.

Layers are grouped into *segments*: a pattern of ``p`` layer shapes repeated ``reps`` times
(XS-2.1: layer 0, then ``[sliding x3, full] x 9``, then sliding x3); each segment is one
``lax.scan`` over its repetitions with the pattern unrolled in the body.

Parameter pytree (``[in, out]`` weights; ``seg{j}_{k}`` = pattern slot ``k`` of segment ``j``,
each leaf stacked on a leading ``reps`` axis)::

    {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "seg{j}_{k}": {"attn_norm": [H], "wq": [H, nh*D], "wk": [H, kv*D], "wv": [H, kv*D],
                    "wo": [nh*D, H], "wg": [H, nh or nh*D], "q_norm": [D], "k_norm": [D],
                    "mlp_norm": [H],
                    dense:  "w_gate": [H, I], "w_up": [H, I], "w_down": [I, H],
                    sparse: "router": [H, E], "router_bias": [E] (float32),
                            "e_gate": [E, H, Im], "e_up": [E, H, Im], "e_down": [E, Im, H],
                            "s_gate": [H, Is], "s_up": [H, Is], "s_down": [Is, H]}}

KV cache (:class:`LagunaCache`): full-attention layers keep one slot per absolute position like
:class:`dflash_jax.runtime.carry.KVCache`; sliding layers keep a ring of ``sliding_window + max_block``
rows (slot ``p % R``) with the position each slot holds in ``ring_pos``. A forward attends the
ring rows *older than its first position* plus its own new rows (kept in registers), then writes
its rows into the ring; so a chunk longer than the ring is exact, and a rolled-back block never
destroys a row that a later query inside the window needs (rows are at most ``max_block`` past
the committed length). Positions ``>= capacity`` are treated as padding: never written, never seen.
"""

from __future__ import annotations

import functools
from typing import Any
import jax
import jax.numpy as jnp
from jax import lax
from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import KV_AXES, axes_field
from dflash_jax.runtime.carry import Capture, move_slots, write_layer_rows, write_rows
from dflash_jax.families.laguna.config import LagunaConfig
from dflash_jax.runtime import carry as captures
from dflash_jax.nn import params as P
from dflash_jax.families.contract import FamilyModel
from dflash_jax.nn.params import ParamSpec, decoder_layer
from dflash_jax.nn.attention import TreeBlock, block_visible, rope_positions
from dflash_jax.nn.layer import swiglu
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.nn.layer import embed
from dflash_jax.nn.layer import attention_output, mlp_residual, project_qkv
from dflash_jax.nn import quant
from dflash_jax.nn.moe import routed_experts
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.layer import rope_tables


Params = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Static structure


def layer_signature(cfg: LagunaConfig, i: int) -> tuple:
    """``(query heads, layer type, mlp type, gate per head[, weight formats])`` of layer ``i``: layers
    with equal signatures have parameters (quantized ones of equal formats) and caches of equal shapes."""
    sig = (cfg.heads_per_layer[i], cfg.layer_types[i], cfg.mlp_layer_types[i], cfg.gate_per_head[i])
    return sig + (cfg.weight_formats[i],) if cfg.weight_formats else sig


def segments(cfg: LagunaConfig, max_period: int = 8) -> tuple[tuple[int, int, int], ...]:
    """Splits the layers into ``(first layer, period p, reps)`` runs of a repeated pattern of
    :func:`layer_signature` (:func:`dflash_jax.nn.params.repeat_segments`); with quantized weights
    patterns up to 12 layers long (XS-2.1's 4 attention kinds times a Q4_K_M file's 3 formats)."""
    period = max(max_period, 12) if cfg.weight_formats else max_period
    return P.repeat_segments([layer_signature(cfg, i) for i in range(cfg.num_hidden_layers)], period)


def layer_slot(cfg: LagunaConfig, layer: int) -> tuple[str, int]:
    """``(params key "seg{j}_{k}", repetition index)`` holding decoder layer ``layer``
    (:func:`~dflash_jax.nn.params.segment_slot`). Raises IndexError for a layer outside the model."""
    return P.segment_slot(segments(cfg), layer)


def _layer_specs(cfg: LagunaConfig, i: int) -> dict:
    """Specs of decoder layer ``i``'s leaves (no layer axis): attention with gate, then the dense
    SwiGLU MLP or the MoE leaves."""
    H = cfg.hidden_size
    dense = cfg.mlp_layer_types[i] == "dense"
    s = decoder_layer(H, cfg.heads_per_layer[i], cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size if dense else 0,
                      qk_norm=True, gate=cfg.gate_width(i))
    if not dense:
        E, Im, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        s.update(
            router=ParamSpec((H, E), ("embed", "experts")), router_bias=ParamSpec((E,), ("experts",), "bias32"),
            e_gate=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")), e_up=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")),
            e_down=ParamSpec((E, Im, H), ("experts", "expert_mlp", "embed")), s_gate=ParamSpec((H, Is), ("embed", "mlp")),
            s_up=ParamSpec((H, Is), ("embed", "mlp")), s_down=ParamSpec((Is, H), ("mlp", "embed")),
        )
    return s


def param_specs(cfg: LagunaConfig) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` (shape, logical axes, initialiser) of every
    parameter leaf, as a pytree shaped like the params (module docstring); the router bias is
    float32 (initialised ``normal(0.1)`` so the selection bias matters)."""
    return P.segmented_specs(cfg, segments(cfg), lambda i: _layer_specs(cfg, i))


# --------------------------------------------------------------------------------------------
# Cache


@pytree.dataclass
class LagunaCache:
    """KV cache of a Laguna target.

    Attributes:
      kv: ``{"seg{j}_{k}": (k, v)}``; full layers ``[reps, B, S, Hkv, D]`` (slot = position),
        sliding layers ``[reps, B, R, Hkv, D]`` (slot = position % R).
      ring_pos: ``[B, R]`` int32 position held by each ring slot (-1 = empty).
      capacity: static ``S``.
    """

    kv: dict = axes_field(*KV_AXES)
    ring_pos: jnp.ndarray = axes_field("batch", None)
    capacity: int = pytree.field(pytree_node=False, default=0)


def cache_entries(cfg: LagunaConfig) -> dict[str, tuple[int, bool]]:
    """``{"seg{j}_{k}": (repetitions, sliding)}``: the cache entries of :func:`init_cache`, each
    stacking the layers of one pattern slot, and whether they are sliding-window layers (a ring)."""
    return {f"seg{j}_{k}": (reps, cfg.layer_types[start + k] == "sliding_attention")
            for j, (start, p, reps) in enumerate(segments(cfg)) for k in range(p)}


def init_cache(cfg: LagunaConfig, batch: int, capacity: int) -> LagunaCache:
    """An empty cache: ``capacity`` slots for full layers, ``cfg.ring_size`` for sliding ones."""
    kv = {}
    ring = cfg.ring_size if "sliding_attention" in cfg.layer_types else 1
    for key, (reps, sliding) in cache_entries(cfg).items():
        shape = (reps, batch, ring if sliding else capacity, cfg.num_key_value_heads, cfg.head_dim)
        kv[key] = (jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
    return LagunaCache(kv=kv, ring_pos=jnp.full((batch, ring), -1, jnp.int32), capacity=int(capacity))


# --------------------------------------------------------------------------------------------
# Layers


def moe(cfg: LagunaConfig, lp: dict, h: jnp.ndarray) -> jnp.ndarray:
    """The sparse MoE block on ``h [..., H]`` -> ``[..., H]`` (module docstring).

    Only the chosen experts are computed (:func:`dflash_jax.nn.moe.routed_experts`).
    """
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    k = cfg.num_experts_per_tok
    logits = quant.dot(x.astype(jnp.float32), quant.astype(lp["router"], jnp.float32), preferred_element_type=jnp.float32)
    if cfg.router_softcap > 0:
        logits = jnp.tanh(logits / cfg.router_softcap) * cfg.router_softcap
    scores = jax.nn.sigmoid(logits) if cfg.router_score == "sigmoid" else jnp.sqrt(jax.nn.softplus(logits))
    _, idx = lax.top_k(scores + lp["router_bias"].astype(jnp.float32), k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    w = (w / jnp.sum(w, axis=-1, keepdims=True)).astype(x.dtype)
    routed = routed_experts(x, idx, w, lp["e_gate"], lp["e_up"], lp["e_down"])
    out = routed * jnp.asarray(cfg.routed_scaling_factor, x.dtype) + swiglu(x, lp["s_gate"], lp["s_up"], lp["s_down"])
    return out.reshape(shape)


def _layer(cfg: LagunaConfig, i: int, lp, x, k_all, v_all, rep, positions, ring_pos, ring_idx, capacity, n_keys, tree=None):
    """Decoder layer ``i`` (static) on ``x [B,T,H]``, whose cache is entry ``rep`` (traced int32)
    of its segment's stacked ``k_all``/``v_all`` ``[reps, B, S, Hkv, D]``; the new rows are
    scattered into the carried stacks in place. A full-attention layer reads only the cache's first
    ``n_keys`` slots (:func:`~dflash_jax.nn.attention.live_keys`), a sliding one its ring.
    ``tree``: the block is a :class:`~dflash_jax.nn.attention.TreeBlock` (RoPE and window by
    depth, ancestors visible). Returns ``(x, k_all, v_all)``."""
    D, hkv = cfg.head_dim, cfg.num_key_value_heads
    sliding = cfg.layer_types[i] == "sliding_attention"
    rope = cfg.rope_sliding if sliding else cfg.rope_full
    inv_freq, scale = rope_tables(rope, D, cfg.attention_factor_rule)
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    rope_pos = rope_positions(positions, tree)
    q, k, v = project_qkv(lp, h, cfg.heads_per_layer[i], hkv, D, rope_pos, inv_freq, cfg.rms_norm_eps, qk_norm=True, rope_scale=scale)
    qpos = rope_pos[:, :, None]
    if sliding:
        win = cfg.sliding_window
        start = positions[:, :1]
        old = (ring_pos >= 0) & (ring_pos < start)
        ring_mask = old[:, None, :] & (qpos - ring_pos[:, None, :] < win)
        kpos = rope_pos[:, None, :]
        seen = (kpos <= qpos) if tree is None else tree.mask
        self_mask = seen & (qpos - kpos < win) & (positions[:, None, :] < capacity)
        a = cache_attention(q, k_all, v_all, rep, k_all.shape[2], lambda slots: jnp.take(ring_mask, slots, axis=2),
                            extra=((k, v, self_mask),))
        k_all, v_all = write_layer_rows(k_all, rep, k, ring_idx), write_layer_rows(v_all, rep, v, ring_idx)
    else:
        k_all, v_all = write_layer_rows(k_all, rep, k, positions), write_layer_rows(v_all, rep, v, positions)
        a = cache_attention(q, k_all, v_all, rep, n_keys, block_visible(positions, tree))
    x = x + attention_output(lp, a, h, gate="head" if cfg.gate_per_head[i] else "element")
    if cfg.mlp_layer_types[i] == "dense":
        return mlp_residual(lp, x, cfg.rms_norm_eps), k_all, v_all
    return x + moe(cfg, lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)), k_all, v_all


def forward_hidden(
    params: Params,
    cfg: LagunaConfig,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cache: LagunaCache,
    capture: Capture | None = None,
    tree: TreeBlock | None = None,
) -> tuple[jnp.ndarray, LagunaCache, Capture | None]:
    """Runs the decoder stack; returns the final-normed hidden states ``[B, T, H]``.

    Args:
      params: parameter pytree (module docstring).
      cfg: static :class:`LagunaConfig`.
      tokens: ``[B, T]`` int32.
      positions: ``[B, T]`` int32 absolute positions, contiguous per row from the row's first
        new position (at or before its committed length); trailing entries ``>= capacity`` are
        padding (not written, not visible to real rows).
      cache: :class:`LagunaCache`; returned with the rows written (the committed length lives
        in ``DecodeState.length``).
      capture: optional :class:`~dflash_jax.runtime.carry.Capture`; every row of every listed layer's
        output residual (HF ``hidden_states[i + 1]``) is written at ``position - base``.
      tree: optional :class:`~dflash_jax.nn.attention.TreeBlock`: the block (contiguous slots
        ``positions``) is a tree of candidates, each at RoPE position first slot + depth and
        seeing its ancestors only (tree verification).
    Returns:
      ``(hidden [B, T, H] in cfg.dtype, cache, capture)``.
    Source: transformers ``LagunaModel.forward`` / ``LagunaDecoderLayer``.
    """
    n_layers = cfg.num_hidden_layers
    capacity = cache.capacity
    positions = positions.astype(jnp.int32)
    x = embed(params, cfg, tokens).astype(cfg.dtype)
    real = positions < capacity
    n_keys = live_keys(positions, capacity)
    last = jnp.max(jnp.where(real, positions, -1), axis=1)
    ring = cache.ring_pos.shape[1]
    ring_ok = real & (positions > last[:, None] - ring)
    ring_idx = jnp.where(ring_ok, positions % ring, ring)
    slot_of = captures.slots(capture, n_layers)
    cap = captures.stack(capture, x)
    new_kv = {}
    for j, (start, p, reps) in enumerate(segments(cfg)):
        keys = [f"seg{j}_{k}" for k in range(p)]
        slots = jnp.asarray(slot_of[start : start + p * reps].reshape(reps, p))

        def body(carry, xs, start=start, p=p):  # the caches ride in the carry: rows scattered in place
            x, cap, kvs = carry
            lps, slot, r = xs
            kvs = list(kvs)
            for k in range(p):
                x, *kvs[k] = _layer(cfg, start + k, lps[k], x, *kvs[k], r, positions, cache.ring_pos, ring_idx, capacity, n_keys, tree)
                cap = captures.keep(capture, cap, x, slot[k])
            return (x, cap, [tuple(kv) for kv in kvs]), None

        xs = ([params[key] for key in keys], slots, jnp.arange(reps, dtype=jnp.int32))
        (x, cap, kvs), _ = lax.scan(body, (x, cap, [tuple(cache.kv[key]) for key in keys]), xs)
        new_kv.update(zip(keys, kvs))
    ring_pos = write_rows(cache.ring_pos[..., None], positions[..., None], ring_idx)[..., 0]
    cache = cache.replace(kv=new_kv, ring_pos=ring_pos)
    final_norm = functools.partial(rms_norm, weight=params["norm"], eps=cfg.rms_norm_eps)
    capture = captures.write(capture, cap, positions, n_layers, final_norm, valid=real)
    return final_norm(x), cache, capture


def move_rows(cfg: LagunaConfig, cache: LagunaCache, src: jnp.ndarray, dst: jnp.ndarray) -> LagunaCache:
    """The cache with the K/V of slot (position) ``src[b, w]`` copied to ``dst[b, w]`` in every
    layer (``[B, W]`` int32): a verified tree's accepted path moved to the slots a chain would have
    written. Full layers move slots, sliding layers their ring rows (``p % R``), and ``ring_pos``
    records the destination positions. Every ``src`` must be a row the last forward wrote.

    Args:
      src, dst: ``[B, W]`` int32 positions; a ``dst`` at or past the capacity is dropped.
    Returns:
      the :class:`LagunaCache` with the rows moved.
    """
    ring = cache.ring_pos.shape[1]
    kv = {}
    for key, (_, sliding) in cache_entries(cfg).items():
        k, v = cache.kv[key]
        s, d = (src % ring, dst % ring) if sliding else (src, dst)
        kv[key] = (move_slots(k, s, d), move_slots(v, s, d))
    dst_ok = jnp.where(dst < cache.capacity, dst % ring, ring)
    ring_pos = write_rows(cache.ring_pos[..., None], dst[..., None], dst_ok)[..., 0]
    return cache.replace(kv=kv, ring_pos=ring_pos)


MODEL = FamilyModel(name="laguna", module=__name__, param_specs=param_specs, forward_hidden=forward_hidden, init_cache=init_cache,
                    move_rows=move_rows, trees=True)
