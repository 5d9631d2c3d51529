"""The DFlash2 drafter (z-lab ``DFlash2DraftModel``): the generic drafter's layers with a grouped
dynamic causal convolution around each attention and MLP sublayer, and a candidate selector
(:mod:`dflash_jax.drafter.selector`) that chooses among the head's top-k tokens per slot.

**Convolution.** Around a sublayer ``f`` with normed input ``h [B, W, H]`` (``W``: the block's
slots), one projection ``h @ kernel_projection`` gives ``2 * K * G`` dynamic taps per slot
(``K = conv_kernel_size``, ``G = H / conv_group_size`` channel groups): the "in" taps and the
"out" taps. The sublayer runs on ``conv_in(h)`` and its output becomes ``conv_out(f(...))``, where
``conv_s(x)[t, c] = sum_{o < K} (base[s, o, c] + dyn[t, s, o, group(c)]) * x[t - o, c]`` with
``x[t - o] = 0`` before the block's first slot: taps never reach across the block's start (nor
into the context, which has no convolution). Both tap sets come from the sublayer's input, so the
out taps see the normed input, not the sublayer's output.

Parameter pytree: the generic drafter's (:mod:`dflash_jax.drafter.generic`), each layer with
``attn_conv_base``/``mlp_conv_base [2, K, H]`` and ``attn_conv_proj``/``mlp_conv_proj [H, 2*K*G]``
(``[in, out]``), plus ``selector: {"proj": [H, R], "pred": [V, R], "succ": [V, R]}``.

Checkpoint (:func:`load_dflash2_drafter_weights`): the generic names plus
``layers.N.{attention_conv,mlp_conv}.{base_kernel, kernel_projection.weight}`` and
``candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}`` (the
codebooks without ``.weight``, as z-lab stores them; ``.weight`` names are accepted too).

Source: z-lab ``dflash/model.py`` (PyPI ``dflash==0.1.0``: ``_grouped_dynamic_convolve``,
``GroupedDynamicCausalConv``, ``Qwen3DFlashDecoderLayer.forward``, ``DFlash2DraftModel``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import generic
from dflash_jax.drafter.config import DFLASH2_DRAFTER, DrafterConfig, _dflash_value, dflash_drafter_config_from_hf
from dflash_jax.errors import DFlashError
from dflash_jax.formats.checkpoint import Checkpoint, load_named
from dflash_jax.nn import params as P
from dflash_jax.nn.attention import cache_attention
from dflash_jax.nn.layer import attention_output, project_qkv, rms_norm, run_layers, swiglu
from dflash_jax.nn.params import ParamSpec
from dflash_jax.nn.quant import dot

context_kv = generic.context_kv  # the context path has no convolution: it is the generic drafter's

_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash2_drafter_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
    """A :class:`~dflash_jax.drafter.config.DrafterConfig` of a z-lab ``DFlash2DraftModel``
    ``config.json``: the generic fields (:func:`dflash_jax.drafter.config.dflash_drafter_config_from_hf`)
    plus ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k`` (in
    ``dflash_config`` or at the top level, as z-lab's ``_draft_value`` reads them).

    Raises:
      DFlashError: a missing or non-positive field, a group size that does not divide
        ``hidden_size``, or ``selector_top_k`` above ``vocab_size`` (names ``source`` and the field).
    """
    base = dflash_drafter_config_from_hf(cfg, source)
    got = {}
    for name in _FIELDS:
        v = _dflash_value(cfg, name, source=source)
        if v is None:
            raise DFlashError(f"{source}: field dflash_config.{name}", "missing", "a positive integer (a DFlash2 drafter)")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DFlashError(f"{source}: field dflash_config.{name}", f"got {v!r}", "a positive integer")
        got[name] = int(v)
    if base.hidden_size % got["conv_group_size"]:
        raise DFlashError(f"{source}: field dflash_config.conv_group_size", f"{got['conv_group_size']} does not divide hidden_size {base.hidden_size}",
                          "a divisor of hidden_size")
    if got["selector_top_k"] > base.vocab_size:
        raise DFlashError(f"{source}: field dflash_config.selector_top_k", f"{got['selector_top_k']} exceeds vocab_size {base.vocab_size}",
                          f"at most {base.vocab_size}")
    return dataclasses.replace(base, architecture=DFLASH2_DRAFTER, **got)


def param_specs(cfg: DrafterConfig) -> dict:
    """The generic drafter's specs plus the convolutions (per layer) and the selector (module
    docstring)."""
    specs = generic.param_specs(cfg)
    H, K, R = cfg.hidden_size, cfg.conv_kernel_size, cfg.selector_rank
    G = H // cfg.conv_group_size
    conv = {f"{s}_conv_base": ParamSpec((cfg.num_hidden_layers, 2, K, H), ("layers", None, None, "embed")) for s in ("attn", "mlp")}
    conv.update({f"{s}_conv_proj": ParamSpec((cfg.num_hidden_layers, H, 2 * K * G), ("layers", "embed", None)) for s in ("attn", "mlp")})
    specs["layers"] = dict(specs["layers"], **conv)
    specs["selector"] = {"proj": ParamSpec((H, R), ("embed", None)), "pred": ParamSpec((cfg.vocab_size, R), ("vocab", None)),
                         "succ": ParamSpec((cfg.vocab_size, R), ("vocab", None))}
    return specs


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every parameter (no draft-vocabulary leaves)."""
    return P.shapes(param_specs(cfg))


def grouped_conv(x: jnp.ndarray, dyn: jnp.ndarray, base: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """The grouped dynamic causal convolution over the block's slots (module docstring).

    Args:
      x: ``[B, W, H]`` the sequence convolved (slot 0: the block's first slot).
      dyn: ``[B, W, K, G]`` dynamic taps per output slot, tap and channel group.
      base: ``[K, H]`` static taps per channel.
      group_size: channels per group (``H = G * group_size``).
    Returns:
      ``[B, W, H]`` in ``x.dtype``: ``sum_o (base[o] + dyn[:, t, o]) * x[:, t - o]`` (zero before slot 0).
    """
    b, w, h = x.shape
    k, g = base.shape[0], h // group_size
    xg = x.reshape(b, w, g, group_size)
    pad = jnp.pad(xg, ((0, 0), (k - 1, 0), (0, 0), (0, 0)))
    out = jnp.zeros_like(xg)
    for o in range(k):  # K is small (a few taps): one shifted product per tap, as z-lab's loop
        shifted = pad[:, k - 1 - o: k - 1 - o + w]
        out = out + base[o].reshape(1, 1, g, group_size).astype(x.dtype) * shifted
        out = out + dyn[:, :, o, :, None].astype(x.dtype) * shifted
    return out.reshape(b, w, h)


def conv_taps(cfg: DrafterConfig, h: jnp.ndarray, proj) -> jnp.ndarray:
    """``[B, W, 2, K, G]`` the in and out taps of a sublayer from its normed input ``h [B, W, H]``."""
    K, G = cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
    return dot(h, proj).reshape(h.shape[:-1] + (2, K, G))


def forward(params_d: dict, cfg_d: DrafterConfig, embeds: jnp.ndarray, positions: jnp.ndarray,
            ctx_k: jnp.ndarray, ctx_v: jnp.ndarray, ctx_len: jnp.ndarray, block_len: jnp.ndarray | None = None,
            live_context: bool = True, pages=None) -> jnp.ndarray:
    """One draft pass over a block (contract of :func:`dflash_jax.drafter.model.forward`): the
    generic layer (:func:`dflash_jax.drafter.generic.forward`) with each sublayer wrapped in its
    convolution (module docstring). Returns ``[B, W, H]`` final-normed hidden states."""
    D, hq, hkv, eps, gs = cfg_d.head_dim, cfg_d.num_attention_heads, cfg_d.num_key_value_heads, cfg_d.rms_norm_eps, cfg_d.conv_group_size
    x, block_len, inv_freq, n_keys = generic.pass_inputs(cfg_d, embeds, ctx_k, ctx_len, block_len, live_context, pages)

    def body(x, lp, layer_xs, i):
        bm, window = layer_xs
        h = rms_norm(x, lp["attn_norm"], eps)
        taps = conv_taps(cfg_d, h, lp["attn_conv_proj"])
        h = grouped_conv(h, taps[:, :, 0], lp["attn_conv_base"][0], gs)
        q, k, v = project_qkv(lp, h, hq, hkv, D, positions, inv_freq, eps, bias=cfg_d.attention_bias, qk_norm=True)
        visible = functools.partial(generic.context_visible, positions, ctx_len, window)
        a = cache_attention(q, ctx_k, ctx_v, i, n_keys, visible, extra=((k, v, bm),), pages=pages)
        x = x + grouped_conv(attention_output(lp, a, h, bias=cfg_d.attention_bias), taps[:, :, 1], lp["attn_conv_base"][1], gs)
        h = rms_norm(x, lp["mlp_norm"], eps)
        taps = conv_taps(cfg_d, h, lp["mlp_conv_proj"])
        h = grouped_conv(h, taps[:, :, 0], lp["mlp_conv_base"][0], gs)
        y = swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"], w_gate_t=lp.get("w_gate_t"), w_up_t=lp.get("w_up_t"))
        return x + grouped_conv(y, taps[:, :, 1], lp["mlp_conv_base"][1], gs)

    xs = (generic.block_masks(cfg_d, positions, block_len), jnp.asarray(cfg_d.layer_window, jnp.int32))
    x = run_layers(body, x, params_d["layers"], xs)
    return rms_norm(x, params_d["norm"], eps)


def drafter_names(cfg: DrafterConfig, prefix: str = "", codebook_suffix: str = "") -> dict:
    """``{tensor name: (pytree path, layer index or None, transpose)}`` of a DFlash2 drafter."""
    names = generic.drafter_names(cfg, prefix)
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in (("attn", "attention_conv"), ("mlp", "mlp_conv")):
            names[f"{prefix}layers.{i}.{theirs}.base_kernel"] = (("layers", f"{ours}_conv_base"), i, False)
            names[f"{prefix}layers.{i}.{theirs}.kernel_projection.weight"] = (("layers", f"{ours}_conv_proj"), i, True)
    names[f"{prefix}candidate_selector.hidden_projection.weight"] = (("selector", "proj"), None, True)
    names[f"{prefix}candidate_selector.predecessor_codebook{codebook_suffix}"] = (("selector", "pred"), None, False)
    names[f"{prefix}candidate_selector.successor_codebook{codebook_suffix}"] = (("selector", "succ"), None, False)
    return names


def load_dflash2_drafter_weights(folder: str, cfg: DrafterConfig, target: np.dtype) -> tuple[DrafterConfig, dict]:
    """Reads the weights of a checked z-lab ``DFlash2DraftModel`` config strictly.

    Returns:
      ``(cfg, params)``: the params pytree of this module.
    Raises:
      DFlashError: missing / unexpected / mis-shaped tensors (each message names the file and
        tensor; a kernel projection's or codebook's shape names what this config expects).
    """
    ckpt = Checkpoint(folder)
    names = set(ckpt.names())
    prefix = "model." if "model.fc.weight" in names else ""
    suffix = ".weight" if f"{prefix}candidate_selector.predecessor_codebook.weight" in names else ""
    params = load_named(ckpt, folder, drafter_names(cfg, prefix, suffix), param_shapes(cfg), target,
                        lambda n: n.endswith("rotary_emb.inv_freq"), "DFlash2 drafter")
    return cfg, params
