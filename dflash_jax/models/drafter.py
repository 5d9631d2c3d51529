"""The DFlash drafter (z-lab ``DFlashDraftModel``) as pure functions over a parameter pytree.

Captured target features are fused (``fc`` then ``hidden_norm``) and injected as context K/V
in every draft layer through that layer's own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at the
context tokens' absolute positions. Queries come only from the block ``[anchor, MASK, ...]``,
embedded with the target's embedding; the final hidden goes through the target's LM head.

Parameter pytree (``[in, out]`` layout, layers stacked on ``Ld``, or a tuple of ``Ld`` per-layer
dicts made by :func:`dflash_jax.models.dense.unstack_layers`, the CPU inference layout)::

    {"fc": [K*H, H], "hidden_norm": [H], "norm": [H],
     "layers": {"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm",
                "w_gate", "w_up", "w_down"  (+ "bq","bk","bv","bo" with attention_bias)}}

Source: z-lab ``dflash/model.py`` (PyPI ``dflash==0.1.0``: ``Qwen3DFlashAttention``,
``DFlashDraftModel.forward``, ``compute_logits``) and ``docs/specs/dflash.md`` sections 1.5-1.8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import LAGUNA_DRAFTER, DrafterConfig, TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.models import drafter_layers
from dflash_jax.models import params as P
from dflash_jax.models.drafter_layers import context_heads
from dflash_jax.models.params import ParamSpec, decoder_layer, stacked
from dflash_jax.nn import embedding
from dflash_jax.nn.norms import rms_norm


def _laguna(cfg: DrafterConfig):
    """The Laguna drafter module when ``cfg.architecture`` is ``DFlashLagunaForCausalLM``."""
    if cfg.architecture == LAGUNA_DRAFTER:
        from dflash_jax.models import laguna_drafter

        return laguna_drafter
    return None


def param_specs(cfg: DrafterConfig) -> dict:
    """The :class:`~dflash_jax.models.params.ParamSpec` (shape, logical axes, initialiser) of every
    drafter parameter, as a pytree shaped like the params (dispatches to
    :mod:`dflash_jax.models.laguna_drafter` for Laguna drafters)."""
    if _laguna(cfg):
        return _with_draft_vocab(cfg, _laguna(cfg).param_specs(cfg))
    H = cfg.hidden_size
    layer = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                          qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
    specs = {"fc": ParamSpec((len(cfg.target_layer_ids) * H, H), ("features", "embed")), "hidden_norm": ParamSpec((H,), ("embed",), "norm"),
             "norm": ParamSpec((H,), ("embed",), "norm"), "layers": stacked(cfg.num_hidden_layers, layer)}
    return _with_draft_vocab(cfg, specs)


def _with_draft_vocab(cfg: DrafterConfig, specs: dict) -> dict:
    """Adds the reduced-vocabulary leaves ``draft_ids [Vd]`` (int32, initialised ``0..Vd-1``) and
    ``draft_head [H, Vd]`` when the config has a draft vocabulary."""
    if not cfg.draft_vocab_size:
        return specs
    Vd = cfg.draft_vocab_size
    return dict(specs, draft_ids=ParamSpec((Vd,), ("draft_vocab",), "arange"),
                draft_head=ParamSpec((cfg.hidden_size, Vd), ("embed", "draft_vocab")))


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every drafter parameter, as a pytree shaped like the params."""
    return P.shapes(param_specs(cfg))


def param_axes(cfg: DrafterConfig, per_layer: bool = False) -> dict:
    """Logical axis names of every drafter parameter leaf (with ``per_layer`` the tree of
    :func:`dflash_jax.models.dense.unstack_layers`: ``Ld`` dicts without the layer axis).

    Raises:
      DFlashError: ``per_layer`` for a Laguna drafter (its layers stay stacked).
    """
    if per_layer and _laguna(cfg):
        raise DFlashError("param_axes(per_layer=True)", "Laguna drafters keep stacked layers", "per_layer=False")
    return P.axes(param_specs(cfg), per_layer)


def init_params(cfg: DrafterConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Random drafter parameters (norm weights near 1) for tests and training from scratch."""
    return P.init(param_specs(cfg), key, scale, cfg.dtype)


def context_kv(params: dict, cfg: DrafterConfig, features: jnp.ndarray, positions: jnp.ndarray):
    """Projects captured target features into every draft layer's context keys and values.

    Args:
      features: ``[B, T, K*H]`` concatenated captured hidden states (K = len(target_layer_ids)).
      positions: ``[B, T]`` int32 absolute positions of those tokens.
    Returns:
      ``(k, v)``, each ``[Ld, B, T, Hkv, D]``: ``k`` is ``k_norm``-ed and rotated, ``v`` raw
      (context rows skip ``input_layernorm``; source: ``Qwen3DFlashAttention.forward``).
      Laguna drafters dispatch to :func:`dflash_jax.models.laguna_drafter.context_kv`.
    """
    if _laguna(cfg):
        return _laguna(cfg).context_kv(params, cfg, features, positions)
    lp = params["layers"]
    c = rms_norm(features.astype(cfg.dtype) @ params["fc"], params["hidden_norm"], cfg.rms_norm_eps)
    if isinstance(lp, (tuple, list)):  # per-layer buffers: project per layer, stack the results
        k = jnp.stack([c @ layer["wk"] for layer in lp])
        v = jnp.stack([c @ layer["wv"] for layer in lp])
        lp = {n: jnp.stack([layer[n] for layer in lp]) for n in ("bk", "bv", "k_norm") if n in lp[0]}
    else:
        k = jnp.einsum("bth,lhd->lbtd", c, lp["wk"])
        v = jnp.einsum("bth,lhd->lbtd", c, lp["wv"])
    if cfg.attention_bias:
        k, v = k + lp["bk"][:, None, None, :], v + lp["bv"][:, None, None, :]
    return context_heads(cfg, k, v, lp["k_norm"], positions)


def forward(
    params: dict,
    cfg: DrafterConfig,
    target_params: dict,
    target_cfg: TargetConfig,
    block_tokens: jnp.ndarray,
    positions: jnp.ndarray,
    ctx_k: jnp.ndarray,
    ctx_v: jnp.ndarray,
    ctx_len: jnp.ndarray,
    block_len: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """One draft pass over a block.

    Args:
      block_tokens: ``[B, W]`` int32, ``[anchor, mask_token_id, ...]``.
      positions: ``[B, W]`` int32 absolute positions (anchor at the row's last committed slot).
      ctx_k, ctx_v: ``[Ld, B, S, Hkv, D]`` context K/V from :func:`context_kv`, slot = position.
      ctx_len: ``[B]`` int32 valid context slots (``[0, ctx_len)``).
      block_len: ``[B]`` int32 existing block slots (default all ``W``).
    Returns:
      ``[B, W, H]`` final-normed hidden states; slot ``i`` predicts the token at
      ``positions[:, i]`` (slot 0 is discarded by callers). Laguna drafters dispatch to
      :func:`dflash_jax.models.laguna_drafter.forward`.
    """
    if _laguna(cfg):
        return _laguna(cfg).forward(params, cfg, target_params, target_cfg, block_tokens, positions, ctx_k, ctx_v, ctx_len, block_len)
    return drafter_layers.forward(params, cfg, target_params, target_cfg, block_tokens, positions, ctx_k, ctx_v, ctx_len, block_len)


def logits(params: dict, cfg: DrafterConfig, target_params: dict, target_cfg, hidden: jnp.ndarray) -> jnp.ndarray:
    """Draft logits float32 of final-normed drafter hidden states ``hidden [..., H]``.

    Through the target's LM head (``target_params``, ``target_cfg``), with the drafter's
    ``output_multiplier`` and optional tanh soft-cap (z-lab ``compute_logits``). Returns
    ``[..., V]``, or ``[..., Vd]`` through ``params["draft_head"]`` when ``cfg.draft_vocab_size``
    is set (map indices back to target ids with :func:`draft_token_ids`).
    """
    if cfg.draft_vocab_size:
        return head_logits(cfg, hidden, params["draft_head"])
    return _finish_logits(cfg, embedding.lm_head(target_params, target_cfg, hidden))


def head_logits(cfg: DrafterConfig, hidden: jnp.ndarray, head: jnp.ndarray) -> jnp.ndarray:
    """Draft logits ``[..., N]`` float32 through ``head [H, N]`` (columns of the target head)."""
    return _finish_logits(cfg, jnp.einsum("...h,hv->...v", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32))


def draft_token_ids(params: dict, cfg: DrafterConfig, index: jnp.ndarray) -> jnp.ndarray:
    """Target token ids of draft-logit indices: ``index [...]`` int -> ``[...]`` int32
    (``draft_ids[index]``; the identity without a draft vocabulary)."""
    return (jnp.take(params["draft_ids"], index) if cfg.draft_vocab_size else index).astype(jnp.int32)


def _finish_logits(cfg: DrafterConfig, out: jnp.ndarray) -> jnp.ndarray:
    out = out * cfg.output_multiplier
    if cfg.final_logit_softcapping > 0:
        cap = cfg.final_logit_softcapping
        out = jnp.tanh(out / cap) * cap
    return out
