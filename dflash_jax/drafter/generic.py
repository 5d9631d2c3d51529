"""Loads z-lab DFlash drafter checkpoints (``config.json`` + safetensors) strictly.

Tensor names as stored by z-lab (``docs/specs/dflash.md`` 1.2): ``fc.weight``, ``hidden_norm.weight``,
``norm.weight`` and ``layers.{i}.*`` in Qwen3 naming; no embedding or LM head (the target's are
used). A ``model.`` prefix is accepted.

The z-lab DFlash drafter kind (``DFlashDraftModel``): its parameters and context K/V.

Captured target features are fused (``fc`` then ``hidden_norm``) and injected as context K/V
in every draft layer through that layer's own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at the
context tokens' absolute positions. Queries come only from the block ``[anchor, MASK, ...]``,
embedded with the target's embedding; the final hidden goes through the target's LM head.

Parameter pytree (``[in, out]`` layout, layers stacked on ``Ld``, or a ``PerLayer`` of ``Ld`` per-layer
dicts made by :func:`dflash_jax.nn.params.unstack_layers`, the CPU inference layout)::

    {"fc": [K*H, H], "hidden_norm": [H], "norm": [H],
     "layers": {"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm",
                "w_gate", "w_up", "w_down"  (+ "bq","bk","bv","bo" with attention_bias)}}

Source: z-lab ``dflash/model.py`` (PyPI ``dflash==0.1.0``: ``Qwen3DFlashAttention``,
``DFlashDraftModel.forward``, ``compute_logits``) and ``docs/specs/dflash.md`` sections 1.5-1.8.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import generic as dflash_drafter
from dflash_jax.drafter import layers as drafter_layers
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.drafter.layers import context_heads
from dflash_jax.errors import DFlashError
from dflash_jax.formats.safetensors import (
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    Checkpoint,
    load_named,
)
from dflash_jax.nn import params as P
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.params import ParamSpec, decoder_layer, stacked

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
    config is parsed and checked by :func:`dflash_jax.drafter.kinds.load_hf_drafter`).

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
    params = load_named(ckpt, folder, drafter_names(cfg, prefix), dflash_drafter.param_shapes(cfg), target,
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
"""One draft pass over a block (:func:`dflash_jax.drafter.layers.forward`)."""
