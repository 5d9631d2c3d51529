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
from dflash_jax.models.dense import run_layers
from dflash_jax.nn import embedding
from dflash_jax.nn.attention import gqa_attention_parts, swiglu
from dflash_jax.nn.norms import rms_norm
from dflash_jax.nn.rope import apply_rope, inv_frequencies


def _laguna(cfg: DrafterConfig):
    """The Laguna drafter module when ``cfg.architecture`` is ``DFlashLagunaForCausalLM``."""
    if cfg.architecture == LAGUNA_DRAFTER:
        from dflash_jax.models import laguna_drafter

        return laguna_drafter
    return None


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every drafter parameter, as a pytree shaped like the params
    (dispatches to :mod:`dflash_jax.models.laguna_drafter` for Laguna drafters)."""
    if _laguna(cfg):
        return _with_draft_vocab(cfg, _laguna(cfg).param_shapes(cfg), (cfg.draft_vocab_size,), (cfg.hidden_size, cfg.draft_vocab_size))
    L, H, I = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kd, D = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim
    layers = {
        "attn_norm": (L, H), "wq": (L, H, qd), "wk": (L, H, kd), "wv": (L, H, kd), "wo": (L, qd, H),
        "q_norm": (L, D), "k_norm": (L, D), "mlp_norm": (L, H),
        "w_gate": (L, H, I), "w_up": (L, H, I), "w_down": (L, I, H),
    }
    if cfg.attention_bias:
        layers.update(bq=(L, qd), bk=(L, kd), bv=(L, kd), bo=(L, H))
    shapes = {"fc": (len(cfg.target_layer_ids) * H, H), "hidden_norm": (H,), "norm": (H,), "layers": layers}
    return _with_draft_vocab(cfg, shapes, (cfg.draft_vocab_size,), (H, cfg.draft_vocab_size))


def _with_draft_vocab(cfg: DrafterConfig, tree: dict, ids, head) -> dict:
    """Adds the reduced-vocabulary leaves ``draft_ids`` / ``draft_head`` when the config has them."""
    return dict(tree, draft_ids=ids, draft_head=head) if cfg.draft_vocab_size else tree


def param_axes(cfg: DrafterConfig, per_layer: bool = False) -> dict:
    """Logical axis names of every drafter parameter leaf (with ``per_layer`` the tree of
    :func:`dflash_jax.models.dense.unstack_layers`: ``Ld`` dicts without the layer axis; not for
    Laguna drafters, which stay stacked)."""
    if _laguna(cfg):
        if per_layer:
            raise ValueError("Laguna drafters keep stacked layers: no per-layer axes")
        return _with_draft_vocab(cfg, _laguna(cfg).param_axes(cfg), ("draft_vocab",), ("embed", "draft_vocab"))
    from dflash_jax.models.dense import _AXES  # same leaf names as the dense target

    shapes = param_shapes(cfg)
    layer = {k: _AXES[k] for k in shapes["layers"]}
    if per_layer:
        layer = tuple({k: v[1:] for k, v in layer.items()} for _ in range(cfg.num_hidden_layers))
    axes = {"fc": ("features", "embed"), "hidden_norm": ("embed",), "norm": ("embed",), "layers": layer}
    return _with_draft_vocab(cfg, axes, ("draft_vocab",), ("embed", "draft_vocab"))


def init_params(cfg: DrafterConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Random drafter parameters (norm weights near 1) for tests and training from scratch."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    out = []
    for (path, shape), k in zip(flat, keys):
        if str(path[-1].key) == "draft_ids":
            out.append(jnp.arange(shape[0], dtype=jnp.int32))
            continue
        x = jax.random.normal(k, shape, jnp.float32)
        x = 1.0 + 0.1 * x if "norm" in str(path[-1].key) else scale * x
        out.append(x.astype(cfg.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _heads(x, n, d):
    return x.reshape(x.shape[:-1] + (n, d))


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
    hkv, D = cfg.num_key_value_heads, cfg.head_dim
    k, v = _heads(k, hkv, D), _heads(v, hkv, D)
    k = rms_norm(k, lp["k_norm"][:, None, None, None, :], cfg.rms_norm_eps)
    inv_freq = inv_frequencies(cfg.rope, D)
    k = jax.vmap(lambda x: apply_rope(x, positions, inv_freq))(k)
    return k, v


def block_masks(cfg: DrafterConfig, positions, ctx_len, block_len, num_ctx: int):
    """Per-layer visibility masks of one block over ``[context slots | block slots]``.

    Args:
      positions: ``[B, W]`` int32 absolute block positions (slot 0 = anchor).
      ctx_len: ``[B]`` int32 number of valid context slots (positions ``[0, ctx_len)``).
      block_len: ``[B]`` int32 block slots that exist (shorter final block, as z-lab's loop).
      num_ctx: static number of context slots.
    Returns:
      ``(ctx_mask [Ld, B, W, S], blk_mask [Ld, B, W, W])`` bool. Causal layers see block slots
      at or before their own; windowed layers see keys with ``|q - k| < window`` (context keys
      are always earlier).
    """
    causal = jnp.asarray(cfg.layer_causal, bool)[:, None, None, None]
    window = jnp.asarray(cfg.layer_window, jnp.int32)[:, None, None, None]
    s = jnp.arange(num_ctx, dtype=jnp.int32)[None, None, :]
    qpos = positions[:, :, None]
    ctx = (s < ctx_len[:, None, None])[None]
    ctx = ctx & ((window == 0) | ((qpos - s)[None] < window))
    w = positions.shape[1]
    off = jnp.arange(w, dtype=jnp.int32)
    kpos = positions[:, None, :]
    blk = (off[None, None, :] < block_len[:, None, None])[None]
    blk = blk & (~causal | (off[None, None, None, :] <= off[None, None, :, None]))
    blk = blk & ((window == 0) | ((jnp.abs(qpos - kpos))[None] < window))
    return ctx, blk


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
    b, w = block_tokens.shape
    if block_len is None:
        block_len = jnp.full((b,), w, jnp.int32)
    D, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inv_freq = inv_frequencies(cfg.rope, D)
    x = (embedding.embed(target_params, block_tokens) * cfg.input_embedding_scale).astype(cfg.dtype)
    ctx_mask, blk_mask = block_masks(cfg, positions, ctx_len, block_len, ctx_k.shape[2])

    def body(x, lp, layer_xs, i):
        ck, cv, cm, bm = layer_xs
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q = apply_rope(rms_norm(_heads(q, hq, D), lp["q_norm"], cfg.rms_norm_eps), positions, inv_freq)
        k = apply_rope(rms_norm(_heads(k, hkv, D), lp["k_norm"], cfg.rms_norm_eps), positions, inv_freq)
        a = gqa_attention_parts(q, ((ck, cv, cm), (k, _heads(v, hkv, D), bm))).reshape(b, w, hq * D) @ lp["wo"]
        if cfg.attention_bias:
            a = a + lp["bo"]
        x = x + a
        x = x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])
        return x

    x = run_layers(body, x, params["layers"], (ctx_k, ctx_v, ctx_mask, blk_mask))
    return rms_norm(x, params["norm"], cfg.rms_norm_eps)


def logits(target_params: dict, target_cfg: TargetConfig, cfg: DrafterConfig, hidden: jnp.ndarray, params: dict | None = None) -> jnp.ndarray:
    """Draft logits float32 through the target's LM head, with the drafter's
    ``output_multiplier`` and optional tanh soft-cap (z-lab ``compute_logits``).

    Returns ``[..., V]``, or ``[..., Vd]`` over the draft vocabulary when
    ``cfg.draft_vocab_size`` is set (then ``params`` must carry ``draft_head``; map indices
    back to target ids with :func:`draft_token_ids`).
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
