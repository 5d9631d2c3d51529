"""The generic z-lab DFlash drafter (``DFlashDraftModel``): its parameters, context K/V, the draft
pass (which the Laguna drafter shares) and its checkpoint loader.

Captured target features are fused (``fc`` then ``hidden_norm``) and injected as context K/V
in every draft layer through that layer's own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at the
context tokens' absolute positions (:func:`context_kv`). Queries come only from the block
``[anchor, MASK, ...]``, embedded with the target's embedding; the final hidden goes through the
target's LM head.

The draft pass over one block (:func:`forward`, shared with :mod:`dflash_jax.drafter.laguna`):
the same pre-norm layer over ``[context K/V | block]``: q/k/v of the block with per-head
``q_norm``/``k_norm`` and RoPE, attention of the block over the cached context plus itself
(per-layer masks from :func:`block_masks`), the optional softplus output gate (``cfg.gate``,
Laguna), ``o_proj`` (+ bias with ``attention_bias``) and a SwiGLU MLP. What differs between the
two kinds (feature fusion and the context K/V input) lives in each kind's module.

Parameter pytree (``[in, out]`` layout, layers stacked on ``Ld``, or a ``PerLayer`` of ``Ld`` per-layer
dicts made by :func:`dflash_jax.nn.params.unstack_layers`, the CPU inference layout)::

    {"fc": [K*H, H], "hidden_norm": [H], "norm": [H],
     "layers": {"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm",
                "w_gate", "w_up", "w_down"  (+ "bq","bk","bv","bo" with attention_bias)}}

Checkpoints (:func:`load_drafter`, strict): tensor names as stored by z-lab
(``docs/specs/dflash.md`` 1.2): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and
``layers.{i}.*`` in Qwen3 naming; no embedding or LM head (the target's are used). A ``model.``
prefix is accepted.

Source: z-lab ``dflash/model.py`` (PyPI ``dflash==0.1.0``: ``Qwen3DFlashAttention``,
``DFlashDraftModel.forward``, ``compute_logits``) and ``docs/specs/dflash.md`` sections 1.5-1.8;
vLLM ``laguna_dflash.py`` (``docs/specs/laguna.md`` 6.4 (e)) for the gate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.errors import DFlashError
from dflash_jax.formats.checkpoint import (
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    Checkpoint,
    load_named,
)
from dflash_jax.nn import params as P
from dflash_jax.nn import quant
from dflash_jax.nn.attention import cache_attention
from dflash_jax.nn.layer import (
    apply_rope,
    attention_output,
    inv_frequencies,
    mlp_residual,
    project_qkv,
    rms_norm,
    run_layers,
    split_heads,
)
from dflash_jax.nn.params import ParamSpec, decoder_layer, stacked


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


def pass_inputs(cfg_d: DrafterConfig, embeds: jnp.ndarray, ctx_k: jnp.ndarray, ctx_len: jnp.ndarray,
                block_len: jnp.ndarray | None, live_context: bool, pages):
    """What every draft pass starts from (arguments as :func:`forward`'s): ``(x [B, W, H] the scaled
    embeddings in cfg_d.dtype, block_len [B] int32 (all ``W`` when None), the RoPE inverse
    frequencies, n_keys: the context keys to scan, traced int32 with ``live_context`` else the capacity)``."""
    b, w = embeds.shape[:2]
    if block_len is None:
        block_len = jnp.full((b,), w, jnp.int32)
    x = (embeds * cfg_d.input_embedding_scale).astype(cfg_d.dtype)
    capacity = ctx_k.shape[2] if pages is None else pages.capacity
    n_keys = jnp.clip(jnp.max(ctx_len), 1, capacity).astype(jnp.int32) if live_context else capacity
    return x, block_len, inv_frequencies(cfg_d.rope, cfg_d.head_dim), n_keys


def forward(params_d: dict, cfg_d: DrafterConfig, embeds: jnp.ndarray, positions: jnp.ndarray,
            ctx_k: jnp.ndarray, ctx_v: jnp.ndarray, ctx_len: jnp.ndarray, block_len: jnp.ndarray | None = None,
            live_context: bool = True, pages=None) -> jnp.ndarray:
    """One draft pass over a block (contract of :func:`dflash_jax.drafter.generic.forward`).

    ``embeds [B, W, H]``: the block ``[anchor, MASK, ...]`` embedded by the target's family
    (:attr:`dflash_jax.families.contract.FamilyModel.embed`); it is multiplied by ``cfg_d.input_embedding_scale``;
    layers run stacked (one scan) or per layer (:func:`dflash_jax.nn.layer.run_layers`).
    Returns ``[B, W, H]`` final-normed hidden states in ``cfg_d.dtype``.
    """
    D, hq, hkv, eps = cfg_d.head_dim, cfg_d.num_attention_heads, cfg_d.num_key_value_heads, cfg_d.rms_norm_eps
    x, block_len, inv_freq, n_keys = pass_inputs(cfg_d, embeds, ctx_k, ctx_len, block_len, live_context, pages)

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

_PER_LAYER = {**ATTENTION_NAMES, **QK_NORM_NAMES, **MLP_NAMES}
_BIASES = {f"self_attn.{p}_proj.bias": (f"b{p}", False) for p in "qkvo"}


def drafter_names(cfg: DrafterConfig, prefix: str = "") -> dict:
    """``{tensor name: (pytree path, layer index or None, transpose)}`` of a generic drafter."""
    names = {
        f"{prefix}fc.weight": (("fc",), None, True),
        f"{prefix}hidden_norm.weight": (("hidden_norm",), None, False),
        f"{prefix}norm.weight": (("norm",), None, False),
    }
    per_layer = dict(_PER_LAYER, **(_BIASES if cfg.attention_bias else {}))
    for i in range(cfg.num_hidden_layers):
        for suffix, (leaf, transpose) in per_layer.items():
            names[f"{prefix}layers.{i}.{suffix}"] = (("layers", leaf), i, transpose)
    return names


def load_dflash_drafter_weights(folder: str, cfg: DrafterConfig, target: np.dtype) -> tuple[DrafterConfig, dict]:
    """Reads the weights of a checked z-lab ``DFlashDraftModel`` config strictly (the folder's
    config is parsed and checked by :func:`dflash_jax.drafter.model.load_hf_drafter`).

    Args:
      folder: holds ``model.safetensors`` (or a sharded index).
      cfg: its parsed config.
      target: parameter numpy dtype.
    Returns:
      ``(cfg, params)``: the params pytree of :mod:`dflash_jax.drafter.generic`.
    Raises:
      DFlashError: an ``fc`` whose width is not ``len(target_layer_ids) * hidden_size``, or
        missing / unexpected / mis-shaped tensors (each message names the file and tensor).
    """
    ckpt = Checkpoint(folder)
    prefix = "model." if "model.fc.weight" in ckpt.names() else ""
    fc = f"{prefix}fc.weight"
    if fc in ckpt.names():
        shape = ckpt.info(fc).shape
        want = (cfg.hidden_size, len(cfg.target_layer_ids) * cfg.hidden_size)
        if shape != want:
            raise DFlashError(
                f"{ckpt.file_of(fc)}: tensor {fc}", f"shape {shape} does not fit {len(cfg.target_layer_ids)} captured layers",
                f"{want} = (hidden_size, len(target_layer_ids) * hidden_size)",
            )
    params = load_named(ckpt, folder, drafter_names(cfg, prefix), param_shapes(cfg), target,
                        lambda n: n.endswith("rotary_emb.inv_freq"), "DFlash drafter")
    return cfg, params


def param_specs(cfg: DrafterConfig) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` (shape, logical axes, initialiser) of every
    parameter (module docstring; the draft-vocabulary leaves are added by
    :func:`dflash_jax.drafter.model.param_specs`)."""
    H = cfg.hidden_size
    layer = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                          qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
    specs = {"fc": ParamSpec((len(cfg.target_layer_ids) * H, H), ("features", "embed")), "hidden_norm": ParamSpec((H,), ("embed",), "norm"),
             "norm": ParamSpec((H,), ("embed",), "norm"), "layers": stacked(cfg.num_hidden_layers, layer)}
    return specs


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every parameter (no draft-vocabulary leaves)."""
    return P.shapes(param_specs(cfg))


def layers_dot(x: jnp.ndarray, w) -> jnp.ndarray:
    """Every layer's projection of ``x``: ``x [B, T, H]`` (shared) or ``[L, B, T, H]`` (one per
    layer) times the stacked ``w [L, H, D]`` -> ``[L, B, T, D]``. A float stack is one einsum; a
    quantized one (:class:`~dflash_jax.nn.quant.QuantizedWeight`) maps :func:`~dflash_jax.nn.quant.dot`
    over its layers."""
    shared = x.ndim == 3
    if not quant.is_quantized(w):
        return jnp.einsum("bth,lhd->lbtd" if shared else "lbth,lhd->lbtd", x, w)
    if shared:
        return jax.vmap(lambda wl: quant.dot(x, wl))(w)
    return jax.vmap(quant.dot)(x, w)


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
    c = rms_norm(quant.dot(features.astype(cfg.dtype), params["fc"]), params["hidden_norm"], cfg.rms_norm_eps)
    if P.is_per_layer(lp):  # per-layer buffers: project per layer, stack the results
        k = jnp.stack([quant.dot(c, layer["wk"]) for layer in lp])
        v = jnp.stack([quant.dot(c, layer["wv"]) for layer in lp])
        lp = {n: jnp.stack([layer[n] for layer in lp]) for n in ("bk", "bv", "k_norm") if n in lp[0]}
    else:
        k, v = layers_dot(c, lp["wk"]), layers_dot(c, lp["wv"])
    if cfg.attention_bias:
        k, v = k + lp["bk"][:, None, None, :], v + lp["bv"][:, None, None, :]
    return context_heads(cfg, k, v, lp["k_norm"], positions)

