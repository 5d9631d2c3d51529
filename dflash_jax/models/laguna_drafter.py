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

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.config import DrafterConfig
from dflash_jax.nn import embedding
from dflash_jax.nn.attention import gqa_attention_parts, swiglu
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope, inv_frequencies


def gate_width(cfg: DrafterConfig) -> int:
    return cfg.num_attention_heads * (1 if cfg.gate == "head" else cfg.head_dim)


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every Laguna drafter parameter (module docstring)."""
    L, H, I = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kd, D = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim
    K = len(cfg.target_layer_ids)
    layers = {
        "attn_norm": (L, H), "wq": (L, H, qd), "wk": (L, H, kd), "wv": (L, H, kd), "wo": (L, qd, H),
        "wg": (L, H, gate_width(cfg)), "q_norm": (L, D), "k_norm": (L, D), "mlp_norm": (L, H),
        "w_gate": (L, H, I), "w_up": (L, H, I), "w_down": (L, I, H),
    }
    return {"fc": (K * H, H), "aux_norm": (K, H), "hidden_norm": (H,), "norm": (H,), "layers": layers}


def param_axes(cfg: DrafterConfig) -> dict:
    """Logical axis names of every Laguna drafter parameter leaf."""
    from dflash_jax.models.dense import _AXES

    axes = dict(_AXES, wg=("layers", "embed", "gate"))
    return {"fc": ("features", "embed"), "aux_norm": ("captures", "embed"), "hidden_norm": ("embed",), "norm": ("embed",),
            "layers": {k: axes[k] for k in param_shapes(cfg)["layers"]}}


def _heads(x, n, d):
    return x.reshape(x.shape[:-1] + (n, d))


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
    hkv, D = cfg.num_key_value_heads, cfg.head_dim
    k, v = _heads(k, hkv, D), _heads(v, hkv, D)
    k = rms_norm(k, lp["k_norm"][:, None, None, None, :], cfg.rms_norm_eps)
    inv_freq = inv_frequencies(cfg.rope, D)
    k = jax.vmap(lambda x: apply_rope(x, positions, inv_freq))(k)
    return k, v


def forward(params, cfg: DrafterConfig, target_params, target_cfg, block_tokens, positions, ctx_k, ctx_v, ctx_len, block_len=None):
    """One draft pass over a block; same contract as :func:`dflash_jax.models.drafter.forward`.

    Returns:
      ``[B, W, H]`` final-normed hidden states; slot ``s >= 1`` predicts the token at
      ``positions[:, s]``.
    """
    from dflash_jax.models.drafter import block_masks

    b, w = block_tokens.shape
    if block_len is None:
        block_len = jnp.full((b,), w, jnp.int32)
    D, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inv_freq = inv_frequencies(cfg.rope, D)
    x = embedding.embed(target_params, block_tokens).astype(cfg.dtype)
    ctx_mask, blk_mask = block_masks(cfg, positions, ctx_len, block_len, ctx_k.shape[2])

    def body(x, xs):
        lp, ck, cv, cm, bm = xs
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        q = apply_rope(rms_norm(_heads(q, hq, D), lp["q_norm"], cfg.rms_norm_eps), positions, inv_freq)
        k = apply_rope(rms_norm(_heads(k, hkv, D), lp["k_norm"], cfg.rms_norm_eps), positions, inv_freq)
        a = gqa_attention_parts(q, ((ck, cv, cm), (k, _heads(v, hkv, D), bm)))
        g = jax.nn.softplus((h @ lp["wg"]).astype(jnp.float32)).astype(a.dtype)
        a = (a * g[..., None]).reshape(b, w, hq * D) if cfg.gate == "head" else a.reshape(b, w, hq * D) * g
        x = x + a @ lp["wo"]
        x = x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])
        return x, None

    x, _ = lax.scan(body, x, (params["layers"], ctx_k, ctx_v, ctx_mask, blk_mask))
    return rms_norm(x, params["norm"], cfg.rms_norm_eps)
