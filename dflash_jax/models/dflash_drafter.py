"""The z-lab DFlash drafter kind (``DFlashDraftModel``): its parameters and context K/V.

Captured target features are fused (``fc`` then ``hidden_norm``) and injected as context K/V
in every draft layer through that layer's own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at the
context tokens' absolute positions. Queries come only from the block ``[anchor, MASK, ...]``,
embedded with the target's embedding; the final hidden goes through the target's LM head.

Parameter pytree (``[in, out]`` layout, layers stacked on ``Ld``, or a ``PerLayer`` of ``Ld`` per-layer
dicts made by :func:`dflash_jax.models.dense.unstack_layers`, the CPU inference layout)::

    {"fc": [K*H, H], "hidden_norm": [H], "norm": [H],
     "layers": {"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm",
                "w_gate", "w_up", "w_down"  (+ "bq","bk","bv","bo" with attention_bias)}}

Source: z-lab ``dflash/model.py`` (PyPI ``dflash==0.1.0``: ``Qwen3DFlashAttention``,
``DFlashDraftModel.forward``, ``compute_logits``) and ``docs/specs/dflash.md`` sections 1.5-1.8.
"""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.config import DrafterConfig
from dflash_jax.models import drafter_layers
from dflash_jax.models import params as P
from dflash_jax.models.drafter_layers import context_heads
from dflash_jax.models.params import ParamSpec, decoder_layer, stacked
from dflash_jax.nn.norms import rms_norm


def param_specs(cfg: DrafterConfig) -> dict:
    """The :class:`~dflash_jax.models.params.ParamSpec` (shape, logical axes, initialiser) of every
    parameter (module docstring; the draft-vocabulary leaves are added by
    :func:`dflash_jax.models.drafter.param_specs`)."""
    H = cfg.hidden_size
    layer = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                          qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
    specs = {"fc": ParamSpec((len(cfg.target_layer_ids) * H, H), ("features", "embed")), "hidden_norm": ParamSpec((H,), ("embed",), "norm"),
             "norm": ParamSpec((H,), ("embed",), "norm"), "layers": stacked(cfg.num_hidden_layers, layer)}
    return specs


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every parameter (no draft-vocabulary leaves)."""
    return P.shapes(param_specs(cfg))


def context_kv(params: dict, cfg: DrafterConfig, features: jnp.ndarray, positions: jnp.ndarray):
    """Projects captured target features into every draft layer's context keys and values.

    Args:
      features: ``[B, T, K*H]`` concatenated captured hidden states (K = len(target_layer_ids)).
      positions: ``[B, T]`` int32 absolute positions of those tokens.
    Returns:
      ``(k, v)``, each ``[Ld, B, T, Hkv, D]``: ``k`` is ``k_norm``-ed and rotated, ``v`` raw
      (context rows skip ``input_layernorm``; source: ``Qwen3DFlashAttention.forward``).
    """
    lp = params["layers"]
    c = rms_norm(features.astype(cfg.dtype) @ params["fc"], params["hidden_norm"], cfg.rms_norm_eps)
    if P.is_per_layer(lp):  # per-layer buffers: project per layer, stack the results
        k = jnp.stack([c @ layer["wk"] for layer in lp])
        v = jnp.stack([c @ layer["wv"] for layer in lp])
        lp = {n: jnp.stack([layer[n] for layer in lp]) for n in ("bk", "bv", "k_norm") if n in lp[0]}
    else:
        k = jnp.einsum("bth,lhd->lbtd", c, lp["wk"])
        v = jnp.einsum("bth,lhd->lbtd", c, lp["wv"])
    if cfg.attention_bias:
        k, v = k + lp["bk"][:, None, None, :], v + lp["bv"][:, None, None, :]
    return context_heads(cfg, k, v, lp["k_norm"], positions)

forward = drafter_layers.forward
"""One draft pass over a block (:func:`dflash_jax.models.drafter_layers.forward`)."""
