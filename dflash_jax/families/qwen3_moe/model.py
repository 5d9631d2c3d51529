"""The Qwen3-MoE decoder (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B) as pure functions.

The family contract (:class:`dflash_jax.families.contract.FamilyModel`, :data:`MODEL`): it declares
``param_specs`` and ``forward_hidden``; the rest (the plain KV cache included) is derived.

Per layer (transformers ``modeling_qwen3_moe.py``)::

    h = rms(x; attn_norm); q,k,v = h Wq, h Wk, h Wv (+ biases with attention_bias);
    q,k = q_norm/k_norm per head, then RoPE; GQA causal attention; x += a Wo
    h2 = rms(x; mlp_norm); x += MoE(h2) on sparse layers, SwiGLU(h2) on the others

MoE (``Qwen3MoeTopKRouter`` / ``Qwen3MoeExperts``): router logits ``h2 Wr`` in the hidden dtype,
softmax over all experts in float32, the top ``k`` probabilities (renormalised to sum 1 when
``norm_topk_prob``) cast to the hidden dtype weight the chosen experts' SwiGLU outputs
(:func:`dflash_jax.nn.moe.routed_experts`: only the chosen experts run). No shared expert.

Layers are grouped into segments of a repeated dense/sparse pattern
(:func:`dflash_jax.nn.params.repeat_segments`: all-sparse Qwen3-30B-A3B is one segment), each
one ``lax.scan``. Parameter pytree (``[in, out]`` weights; ``seg{j}_{k}`` = pattern slot ``k`` of
segment ``j``, each leaf stacked on a leading ``reps`` axis)::

    {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "seg{j}_{k}": {"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm"
                    (as :func:`dflash_jax.nn.params.decoder_layer`; "bq","bk","bv","bo" with attention_bias),
                    dense:  "w_gate": [H, I], "w_up": [H, I], "w_down": [I, H],
                    sparse: "router": [H, E], "e_gate": [E, H, Im], "e_up": [E, H, Im], "e_down": [E, Im, H]}}

The KV cache is the dense family's :class:`~dflash_jax.runtime.carry.KVCache` ``[L, B, S, Hkv, D]``
(every layer attends every position).
"""

from __future__ import annotations

import functools
from typing import Any
import jax.numpy as jnp
from jax import lax
from dflash_jax.runtime.carry import Capture, KVCache
from dflash_jax.families.qwen3_moe.config import Qwen3MoeConfig
from dflash_jax.runtime import carry as captures
from dflash_jax.nn import params as P
from dflash_jax.families.contract import FamilyModel
from dflash_jax.nn.params import ParamSpec, decoder_layer
from dflash_jax.nn.attention import TreeBlock, block_visible, rope_positions
from dflash_jax.nn.layer import embed
from dflash_jax.nn.layer import attention_output, mlp_residual, project_qkv
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.nn import quant
from dflash_jax.nn.moe import routed_experts, softmax_top_k
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.layer import inv_frequencies


Params = dict[str, Any]


def segments(cfg: Qwen3MoeConfig) -> tuple[tuple[int, int, int], ...]:
    """``(first layer, period, reps)`` runs of a repeated dense/sparse pattern (module docstring; layers
    of quantized weights stack only with layers of their formats, ``cfg.weight_formats``)."""
    return P.repeat_segments(list(zip(cfg.sparse_layers, cfg.weight_formats)) if cfg.weight_formats else list(cfg.sparse_layers))


def layer_slot(cfg: Qwen3MoeConfig, layer: int) -> tuple[str, int]:
    """``(params key "seg{j}_{k}", repetition index)`` holding decoder layer ``layer``
    (:func:`~dflash_jax.nn.params.segment_slot`). Raises IndexError for a layer outside the model."""
    return P.segment_slot(segments(cfg), layer)


def _layer_specs(cfg: Qwen3MoeConfig, i: int) -> dict:
    H, sparse = cfg.hidden_size, cfg.sparse_layers[i]
    s = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 0 if sparse else cfg.intermediate_size,
                      qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
    if sparse:
        E, Im = cfg.num_experts, cfg.moe_intermediate_size
        s.update(router=ParamSpec((H, E), ("embed", "experts")),
                 e_gate=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")),
                 e_up=ParamSpec((E, H, Im), ("experts", "embed", "expert_mlp")),
                 e_down=ParamSpec((E, Im, H), ("experts", "expert_mlp", "embed")))
    return s


def param_specs(cfg: Qwen3MoeConfig) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` of every parameter leaf (module docstring);
    experts over the ``"experts"`` logical axis (mesh axis ``expert``), each expert's width over
    ``"expert_mlp"`` (mesh axis ``model``)."""
    return P.segmented_specs(cfg, segments(cfg), lambda i: _layer_specs(cfg, i))


def moe(cfg: Qwen3MoeConfig, lp: dict, h: jnp.ndarray) -> jnp.ndarray:
    """The sparse MoE block on ``h [..., H]`` -> ``[..., H]`` in ``h.dtype`` (module docstring).
    Source: transformers ``Qwen3MoeSparseMoeBlock`` / ``Qwen3MoeTopKRouter``."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    w, idx = softmax_top_k(quant.dot(x, quant.astype(lp["router"], x.dtype)), cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return routed_experts(x, idx, w.astype(x.dtype), lp["e_gate"], lp["e_up"], lp["e_down"]).reshape(shape)


def _layer(cfg: Qwen3MoeConfig, i: int, lp, x, cache, layer, positions, rope_pos, visible, n_keys, inv_freq):
    """Decoder layer ``i`` (static: its MLP kind) on ``x [B,T,H]``; writes its K/V rows into the
    stacked cache at ``layer`` (traced int32) and attends the first ``n_keys`` slots under
    ``visible``. Returns ``(x, cache)``."""
    eps = cfg.rms_norm_eps
    h = rms_norm(x, lp["attn_norm"], eps)
    q, k, v = project_qkv(lp, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rope_pos, inv_freq, eps,
                          bias=cfg.attention_bias, qk_norm=True)
    cache = cache.written(layer, k, v, positions)
    x = x + attention_output(lp, cache_attention(q, cache.k, cache.v, layer, n_keys, visible, pages=cache.pages), h, bias=cfg.attention_bias)
    if not cfg.sparse_layers[i]:
        return mlp_residual(lp, x, eps), cache
    return x + moe(cfg, lp, rms_norm(x, lp["mlp_norm"], eps)), cache


def forward_hidden(
    params: Params,
    cfg: Qwen3MoeConfig,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cache: KVCache,
    capture: Capture | None = None,
    tree: TreeBlock | None = None,
) -> tuple[jnp.ndarray, KVCache, Capture | None]:
    """Runs the decoder stack; returns ``(final-normed hidden [B, T, H] in cfg.dtype, cache, capture)``.

    Same contract as :attr:`dflash_jax.families.contract.FamilyModel.forward_hidden`: ``tokens``/``positions``
    ``[B, T]`` int32 (positions contiguous per row, K/V of token ``t`` written to slot
    ``positions[b, t]``, slots past the capacity dropped); ``capture`` receives every listed
    layer's output residual; ``tree`` verifies a tree of candidates.
    Raises :class:`~dflash_jax.errors.DFlashError` for a capture layer id outside the target.
    Source: transformers ``Qwen3MoeModel.forward`` / ``Qwen3MoeDecoderLayer``.
    """
    n_layers = cfg.num_hidden_layers
    inv_freq = inv_frequencies(cfg.rope, cfg.head_dim)
    positions = positions.astype(jnp.int32)
    n_keys = live_keys(positions, cache.capacity)
    rope_pos, visible = rope_positions(positions, tree), block_visible(positions, tree)
    x = embed(params, cfg, tokens).astype(cfg.dtype)
    slot_of = captures.slots(capture, n_layers)
    cap = captures.stack(capture, x)
    for j, (start, p, reps) in enumerate(segments(cfg)):

        def body(carry, xs, start=start, p=p):  # the cache rides in the carry: rows scattered in place
            x, cap, cache = carry
            lps, slot, r = xs
            for k in range(p):
                layer = start + r * p + k
                x, cache = _layer(cfg, start + k, lps[k], x, cache, layer, positions, rope_pos, visible, n_keys, inv_freq)
                cap = captures.keep(capture, cap, x, slot[k])
            return (x, cap, cache), None

        slots = jnp.asarray(slot_of[start : start + p * reps].reshape(reps, p))
        xs = ([params[f"seg{j}_{k}"] for k in range(p)], slots, jnp.arange(reps, dtype=jnp.int32))
        (x, cap, cache), _ = lax.scan(body, (x, cap, cache), xs)
    final_norm = functools.partial(rms_norm, weight=params["norm"], eps=cfg.rms_norm_eps)
    capture = captures.write(capture, cap, positions, n_layers, final_norm)
    return final_norm(x), cache, capture


MODEL = FamilyModel(name="qwen3_moe", module=__name__, param_specs=param_specs, forward_hidden=forward_hidden, paged_kv=True,
                    trees=True)
