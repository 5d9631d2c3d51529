"""The gpt-oss decoder (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b) as pure functions.

The family contract (:class:`dflash_jax.families.contract.FamilyModel`). Per layer (transformers
``modeling_gpt_oss.py``)::

    h = rms(x; attn_norm); q,k,v = h Wq + bq, h Wk + bk, h Wv + bv; RoPE (YaRN, cos/sin scaled);
    GQA attention whose softmax denominator also holds exp(sinks[head]) (a zero-valued key);
    sliding layers see keys less than sliding_window positions back; x += a Wo + bo
    h2 = rms(x; mlp_norm); logits = h2 Wr + br; the top-k logits softmaxed weight the chosen
    experts: down((clip(u, -l, l) + 1) * g' sigmoid(alpha g')) + b_down, g' = min(g, l),
    g = h2 We_gate + b, u = h2 We_up + b (:func:`dflash_jax.nn.moe.clamped_glu`); x += that

Layers are grouped into segments of a repeated sliding/full pattern
(:func:`dflash_jax.nn.params.repeat_segments`: alternating layers are one segment of period 2).
Parameter pytree (``[in, out]`` weights; ``seg{j}_{k}`` stacked on a leading ``reps`` axis)::

    {"embed": [V, H], "norm": [H], "lm_head": [H, V] (absent when tied),
     "seg{j}_{k}": {"attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "mlp_norm"
                    (:func:`dflash_jax.nn.params.decoder_layer`), "sinks": [Hq] float32,
                    "router": [H, E], "router_bias": [E], "e_gate", "e_up": [E, H, I], "e_down": [E, I, H],
                    "eb_gate", "eb_up": [E, I], "eb_down": [E, H]}}

The KV cache is the dense :class:`~dflash_jax.runtime.carry.KVCache` (every position of every layer is
kept; a sliding layer masks the keys outside its window, so its attention still reads the live
prefix: correct, not yet the O(window) ring Laguna keeps).
"""

from __future__ import annotations

import functools
from typing import Any
import jax
import jax.numpy as jnp
from jax import lax
from dflash_jax.runtime.carry import Capture, KVCache
from dflash_jax.families.gpt_oss.config import GptOssConfig
from dflash_jax.errors import DFlashError
from dflash_jax.runtime import carry as captures
from dflash_jax.nn import params as P
from dflash_jax.families.contract import FamilyModel
from dflash_jax.nn.params import ParamSpec, decoder_layer
from dflash_jax.nn.attention import TreeBlock, block_visible, rope_positions, windowed
from dflash_jax.nn.layer import embed
from dflash_jax.nn.layer import attention_output, project_qkv
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.nn import quant
from dflash_jax.nn.moe import clamped_glu, routed_experts
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.layer import rope_tables


Params = dict[str, Any]


def segments(cfg: GptOssConfig) -> tuple[tuple[int, int, int], ...]:
    """``(first layer, period, reps)`` runs of a repeated sliding/full pattern (layers of quantized
    weights stack only with layers of their formats, ``cfg.weight_formats``)."""
    return P.repeat_segments(list(zip(cfg.layer_types, cfg.weight_formats)) if cfg.weight_formats else list(cfg.layer_types))


def layer_slot(cfg: GptOssConfig, layer: int) -> tuple[str, int]:
    """``(params key "seg{j}_{k}", repetition index)`` holding decoder layer ``layer``
    (:func:`~dflash_jax.nn.params.segment_slot`). Raises IndexError for a layer outside the model."""
    return P.segment_slot(segments(cfg), layer)


def _layer_specs(cfg: GptOssConfig) -> dict:
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    s = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 0, qkv_bias=True, o_bias=True)
    s.update(sinks=ParamSpec((cfg.num_attention_heads,), ("q_heads",), "bias32"),
             router=ParamSpec((H, E), ("embed", "experts")), router_bias=ParamSpec((E,), ("experts",)),
             e_gate=ParamSpec((E, H, I), ("experts", "embed", "expert_mlp")), e_up=ParamSpec((E, H, I), ("experts", "embed", "expert_mlp")),
             e_down=ParamSpec((E, I, H), ("experts", "expert_mlp", "embed")), eb_gate=ParamSpec((E, I), ("experts", "expert_mlp")),
             eb_up=ParamSpec((E, I), ("experts", "expert_mlp")), eb_down=ParamSpec((E, H), ("experts", "embed")))
    return s


def param_specs(cfg: GptOssConfig) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` of every parameter leaf (module
    docstring); experts over the ``"experts"`` logical axis; ``sinks`` float32."""
    return P.segmented_specs(cfg, segments(cfg), lambda i: _layer_specs(cfg))


def moe(cfg: GptOssConfig, lp: dict, h: jnp.ndarray) -> jnp.ndarray:
    """The MoE block on ``h [..., H]`` -> ``[..., H]`` in ``h.dtype``. Source: transformers
    ``GptOssTopKRouter`` (top-k of the biased logits, softmax over those k) and ``GptOssExperts``."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    logits = quant.dot(x, quant.astype(lp["router"], x.dtype)) + lp["router_bias"].astype(x.dtype)
    top, idx = lax.top_k(logits, cfg.num_experts_per_tok)
    w = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x.dtype)
    y = routed_experts(x, idx, w, lp["e_gate"], lp["e_up"], lp["e_down"], biases=(lp["eb_gate"], lp["eb_up"], lp["eb_down"]),
                       act=clamped_glu(cfg.swiglu_limit, cfg.swiglu_alpha))
    return y.reshape(shape)


def _layer(cfg: GptOssConfig, i: int, lp, x, cache, layer, positions, rope_pos, visible, n_keys, rope):
    """Decoder layer ``i`` (static: its attention type) on ``x [B,T,H]``; writes its K/V rows into
    the stacked cache at ``layer`` (traced int32). Returns ``(x, cache)``."""
    eps, (inv_freq, scale) = cfg.rms_norm_eps, rope
    h = rms_norm(x, lp["attn_norm"], eps)
    q, k, v = project_qkv(lp, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rope_pos, inv_freq, eps,
                          bias=True, rope_scale=scale)
    cache = cache.written(layer, k, v, positions)
    vis = visible[cfg.layer_types[i] == "sliding_attention"]
    x = x + attention_output(lp, cache_attention(q, cache.k, cache.v, layer, n_keys, vis, sinks=lp["sinks"], pages=cache.pages), h, bias=True)
    return x + moe(cfg, lp, rms_norm(x, lp["mlp_norm"], eps)), cache


def forward_hidden(
    params: Params,
    cfg: GptOssConfig,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cache: KVCache,
    capture: Capture | None = None,
    tree: TreeBlock | None = None,
) -> tuple[jnp.ndarray, KVCache, Capture | None]:
    """Runs the decoder stack; returns ``(final-normed hidden [B, T, H] in cfg.dtype, cache, capture)``.

    Same contract as :attr:`dflash_jax.families.contract.FamilyModel.forward_hidden` (``tokens``/``positions``
    ``[B, T]`` int32, capture of listed layers' output residuals, ``tree`` verification).
    Raises :class:`~dflash_jax.errors.DFlashError` for a capture layer id outside the target, or
    a tree of more tokens than the sliding window. Source: transformers ``GptOssModel.forward``.
    """
    n_layers = cfg.num_hidden_layers
    rope = rope_tables(cfg.rope, cfg.head_dim)
    positions = positions.astype(jnp.int32)
    n_keys = live_keys(positions, cache.capacity)
    rope_pos, full = rope_positions(positions, tree), block_visible(positions, tree)
    if tree is not None and tree.mask.shape[-1] > cfg.sliding_window > 0:
        raise DFlashError("tree", f"{tree.mask.shape[-1]} tokens in one verify pass", f"at most sliding_window={cfg.sliding_window}")
    visible = (full, windowed(full, positions, rope_pos, cfg.sliding_window, tree) if cfg.sliding_window else full)
    x = embed(params, cfg, tokens).astype(cfg.dtype)
    slot_of = captures.slots(capture, n_layers)
    cap = captures.stack(capture, x)
    for j, (start, p, reps) in enumerate(segments(cfg)):

        def body(carry, xs, start=start, p=p):  # the cache rides in the carry: rows scattered in place
            x, cap, cache = carry
            lps, slot, r = xs
            for k in range(p):
                x, cache = _layer(cfg, start + k, lps[k], x, cache, start + r * p + k, positions, rope_pos, visible,
                                         n_keys, rope)
                cap = captures.keep(capture, cap, x, slot[k])
            return (x, cap, cache), None

        slots = jnp.asarray(slot_of[start : start + p * reps].reshape(reps, p))
        xs = ([params[f"seg{j}_{k}"] for k in range(p)], slots, jnp.arange(reps, dtype=jnp.int32))
        (x, cap, cache), _ = lax.scan(body, (x, cap, cache), xs)
    final_norm = functools.partial(rms_norm, weight=params["norm"], eps=cfg.rms_norm_eps)
    capture = captures.write(capture, cap, positions, n_layers, final_norm)
    return final_norm(x), cache, capture


MODEL = FamilyModel(name="gpt_oss", module=__name__, param_specs=param_specs, forward_hidden=forward_hidden, paged_kv=True,
                    trees=True)
