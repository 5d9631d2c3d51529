"""The Laguna DFlash drafter (``DFlashLagunaForCausalLM``) as pure functions.

Differences from the generic z-lab drafter (``docs/specs/laguna.md`` 6.4 and 6.6; reference: vLLM
``laguna_dflash.py`` + ``v1/spec_decode/dflash.py``):

* fusion: each captured slice gets its own RMSNorm (``aux_hidden_norms.j``) before
  ``concat -> fc -> hidden_norm``;
* context K/V: the fused context goes through each layer's ``input_layernorm`` before that
  layer's K/V projection, then ``k_norm`` and RoPE at the context tokens' absolute positions;
* every layer has a softplus output gate ``softplus(float32(h Wg))`` (per head or per element)
  on the attention output before ``o_proj``, ``h`` the normed layer input;
* block attention is causal (``dflash_config.causal``) and sliding layers limit every query to
  keys with ``q_pos - k_pos < sliding_window`` over ``[context | block]`` (vLLM's per-query window);
* ``qkv_proj`` is packed in the checkpoint (split by head counts at load time).

Parameter pytree (``[in, out]`` layout, layers stacked on ``Ld``)::

    {"fc": [K*H, H], "aux_norm": [K, H], "hidden_norm": [H], "norm": [H],
     "layers": {"attn_norm", "wq", "wk", "wv", "wo", "wg" [Ld, H, nh or nh*D], "q_norm", "k_norm",
                "mlp_norm", "w_gate", "w_up", "w_down"}}
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
    """The :class:`~dflash_jax.models.params.ParamSpec` of every Laguna drafter parameter (module
    docstring; the draft-vocabulary leaves are added by :func:`dflash_jax.models.drafter.param_specs`)."""
    H = cfg.hidden_size
    gate = cfg.num_attention_heads * (1 if cfg.gate == "head" else cfg.head_dim)
    layer = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                          qk_norm=True, gate=gate)
    return {"fc": ParamSpec((len(cfg.target_layer_ids) * H, H), ("features", "embed")),
            "aux_norm": ParamSpec((len(cfg.target_layer_ids), H), ("captures", "embed"), "norm"),
            "hidden_norm": ParamSpec((H,), ("embed",), "norm"), "norm": ParamSpec((H,), ("embed",), "norm"),
            "layers": stacked(cfg.num_hidden_layers, layer)}


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every Laguna drafter parameter (module docstring)."""
    return P.shapes(param_specs(cfg))


def fuse(params: dict, cfg: DrafterConfig, features: jnp.ndarray) -> jnp.ndarray:
    """``[B, T, K*H]`` captured features -> ``[B, T, H]`` fused context
    ``hidden_norm(fc(concat_j aux_norm_j(slice_j))))`` (vLLM ``combine_hidden_states``)."""
    b, t, _ = features.shape
    K, H = len(cfg.target_layer_ids), cfg.hidden_size
    f = rms_norm(features.astype(cfg.dtype).reshape(b, t, K, H), params["aux_norm"], cfg.rms_norm_eps)
    return rms_norm(f.reshape(b, t, K * H) @ params["fc"], params["hidden_norm"], cfg.rms_norm_eps)


def context_kv(params: dict, cfg: DrafterConfig, features: jnp.ndarray, positions: jnp.ndarray):
    """Context keys and values of every drafter layer.

    Args:
      features: ``[B, T, K*H]`` captured target residuals (K = len(target_layer_ids)).
      positions: ``[B, T]`` int32 absolute positions.
    Returns:
      ``(k, v)`` each ``[Ld, B, T, Hkv, D]``; ``k = RoPE(k_norm(input_layernorm(c) Wk))``,
      ``v = input_layernorm(c) Wv`` (vLLM ``precompute_and_store_context_kv``).
    """
    lp = params["layers"]
    c = fuse(params, cfg, features)
    u = rms_norm(c[None], lp["attn_norm"][:, None, None, :], cfg.rms_norm_eps)
    k = jnp.einsum("lbth,lhd->lbtd", u, lp["wk"])
    v = jnp.einsum("lbth,lhd->lbtd", u, lp["wv"])
    return context_heads(cfg, k, v, lp["k_norm"], positions)


forward = drafter_layers.forward
"""One draft pass over a block (:func:`dflash_jax.models.drafter_layers.forward`: the generic
drafter's layers with this config's softplus gate, causal block and sliding windows)."""
