"""The pieces of a pre-norm decoder layer every model here shares, and the runner over its layers.

**RMSNorm** as in Llama/Qwen (``w * x / sqrt(mean(x^2) + eps)``, statistics in float32).

**Rotary position embeddings** (rotate-half / NeoX convention, as in transformers). Frequencies are computed in NumPy at trace time from the static
:class:`~dflash_jax.families.hf_config.RopeConfig`, so they are constants in the compiled program; every
family (dense, Laguna, the drafters) uses the same functions. Source: transformers
``modeling_rope_utils`` (default, linear, llama3, yarn) and ``apply_rotary_pos_emb``.

**The input embedding and output head** every target family shares. A target's params carry ``embed [V, H]`` and, untied or after
:func:`dflash_jax.loading.with_output_head`, ``lm_head [H, V]``; the drafters read the target's
through the family's :class:`~dflash_jax.families.contract.FamilyModel` (these functions for the families
that neither scale the embedding nor soft-cap the logits).

**A decoder layer** (dense targets, Laguna, both drafters), over one layer's parameter dict ``lp`` (leaf names of
:func:`dflash_jax.nn.params.decoder_layer`, ``[in, out]`` weights).

Per layer: ``h = rms(x; attn_norm)``; :func:`project_qkv` (projections, optional biases, heads,
optional per-head q/k norm, RoPE); the model's own attention; :func:`attention_output` (optional
softplus gate, ``wo``, optional ``bo``); ``x += that``; :func:`mlp_residual`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from dflash_jax.families.hf_config import RopeConfig
from dflash_jax.nn import params as layouts
from dflash_jax.nn import quant


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMS-normalises the last axis of ``x`` and scales by ``weight``.

    Args:
      x: ``[..., D]`` any float dtype.
      weight: ``[D]``.
      eps: added to the mean square.
    Returns:
      ``[..., D]`` in ``x.dtype``. Follows transformers ``LlamaRMSNorm`` (float32 statistics,
      cast back before the weight multiply).
    """
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jnp.reciprocal(jnp.sqrt(var + eps))).astype(x.dtype) * weight.astype(x.dtype)


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``[rot // 2]`` float64 for the rotating part of a head.

    ``rot = int(head_dim * rope.partial)`` rounded down to even; default ``theta^(-2j/rot)``.
    ``linear`` divides by ``factor``; ``llama3`` scales long wavelengths (Llama 3.1); ``yarn`` as
    transformers ``_compute_yarn_parameters`` with ``dim = rot`` (correction range floored/ceiled
    when ``truncate``, linear ramp, ``low == high`` nudged by 0.001). The YaRN cos/sin scale is
    :func:`yarn_scale`'s.
    """
    rot = int(head_dim * rope.partial)
    rot -= rot % 2
    inv = 1.0 / (rope.theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        return _llama3(rope, inv)
    if rope.kind == "yarn":
        return _yarn(rope, inv, rot)
    return inv


def _llama3(rope: RopeConfig, inv: np.ndarray) -> np.ndarray:
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, (1 - smooth) * inv / rope.factor + smooth * inv, scaled)


def _yarn(rope: RopeConfig, inv: np.ndarray, rot: int) -> np.ndarray:
    def corr(n_rot):
        return rot * math.log(rope.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = corr(rope.beta_fast), corr(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rot // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    return (inv / rope.factor) * (1 - extrap) + inv * extrap


def yarn_scale(rope: RopeConfig, rule: str = "transformers") -> float:
    """The factor multiplying cos and sin (1.0 unless ``rope.kind == "yarn"``).

    ``rule="transformers"``: the config's ``attention_factor`` when present, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given, else
    ``0.1 ln(factor) + 1`` (transformers ``_compute_yarn_parameters``). ``"derived"``: always
    ``0.1 ln(factor) + 1`` (vLLM ``get_rope``). Applied once, never squared (docs/specs/laguna.md 9.1).
    """
    if rope.kind != "yarn":
        return 1.0

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rule == "transformers" and rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rule == "transformers" and rope.mscale and rope.mscale_all_dim:
        return float(get_mscale(rope.factor, rope.mscale) / get_mscale(rope.factor, rope.mscale_all_dim))
    return float(get_mscale(rope.factor))


def rope_tables(rope: RopeConfig, head_dim: int, rule: str = "transformers") -> tuple[np.ndarray, float]:
    """``(inv_freq [rot/2] float64, cos/sin scale)``: :func:`inv_frequencies` and :func:`yarn_scale`."""
    return inv_frequencies(rope, head_dim), yarn_scale(rope, rule)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> jnp.ndarray:
    """Rotates the first ``2 * len(inv_freq)`` channels of each head of ``x``.

    Args:
      x: ``[B, T, heads, head_dim]``.
      positions: ``[B, T]`` int32 absolute positions.
      inv_freq: ``[rot_dim // 2]`` from :func:`inv_frequencies`.
      scale: multiplies cos and sin (YaRN attention factor; 1.0 otherwise).
    Returns:
      ``[B, T, heads, head_dim]`` in ``x.dtype``; channels past ``rot_dim`` pass through.
    """
    rot = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B,T,rot/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    xr = x[..., :rot].astype(jnp.float32)
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    if rot == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rot:]], axis=-1)


def embed(params: dict, cfg, tokens: jnp.ndarray) -> jnp.ndarray:
    """``[B, T]`` int32 -> ``[B, T, H]`` rows of ``params["embed"]`` in its dtype (no scaling;
    ``cfg`` unused: the family contract, :class:`dflash_jax.families.contract.FamilyModel`); a
    quantized embedding (:class:`~dflash_jax.nn.quant.QuantizedWeight` of ``V`` rows) dequantizes
    only the gathered rows (:func:`dflash_jax.nn.quant.take_rows`)."""
    return quant.take_rows(params["embed"], tokens)


def lm_head(params: dict, cfg, hidden: jnp.ndarray) -> jnp.ndarray:
    """Final-normed hidden ``[..., H]`` -> float32 logits ``[..., V]`` through ``params["lm_head"]
    [H, V]`` when present (or its ``[V, H]`` copy ``lm_head_t`` in a pass of
    :data:`~dflash_jax.nn.params.HEAD_MIN_ROWS` rows or more), else the tied embedding ``[V, H]``
    (``cfg`` unused: the model API). Quantized heads and embeddings go through :func:`dflash_jax.nn.quant.dot`
    (a quantized embedding of ``V`` rows stands for the ``[H, V]`` head)."""
    if "lm_head" in params:
        return layouts.project(hidden, params["lm_head"], params.get("lm_head_t"), layouts.HEAD_MIN_ROWS, jnp.float32)
    if quant.is_quantized(params["embed"]):
        return quant.dot(hidden, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...h,vh->...v", hidden, params["embed"], preferred_element_type=jnp.float32)


def split_heads(x: jnp.ndarray, n: int, d: int) -> jnp.ndarray:
    """``[..., n*d]`` -> ``[..., n, d]``."""
    return x.reshape(x.shape[:-1] + (n, d))


def project_qkv(lp: dict, h: jnp.ndarray, q_heads: int, kv_heads: int, head_dim: int, positions: jnp.ndarray,
                inv_freq: np.ndarray, eps: float, *, bias: bool = False, qk_norm: bool = False, rope_scale: float = 1.0):
    """Queries, keys and values of the normed layer input ``h [B, T, H]``.

    ``q = h Wq (+ bq)`` split into ``q_heads`` heads of ``head_dim``, ``rms(q; q_norm)`` with
    ``qk_norm``, then RoPE at ``positions [B, T]`` (``inv_freq``, cos/sin times ``rope_scale``);
    ``k`` the same with ``kv_heads``; ``v = h Wv (+ bv)`` in heads, not rotated. The weights are
    float or :class:`~dflash_jax.nn.quant.QuantizedWeight` (:func:`dflash_jax.nn.quant.dot`).

    Returns:
      ``(q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D])`` in ``h.dtype``.
    """
    q, k, v = quant.dot(h, lp["wq"]), quant.dot(h, lp["wk"]), quant.dot(h, lp["wv"])
    if bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k, v = split_heads(q, q_heads, head_dim), split_heads(k, kv_heads, head_dim), split_heads(v, kv_heads, head_dim)
    if qk_norm:
        q, k = rms_norm(q, lp["q_norm"], eps), rms_norm(k, lp["k_norm"], eps)
    return apply_rope(q, positions, inv_freq, rope_scale), apply_rope(k, positions, inv_freq, rope_scale), v


def attention_output(lp: dict, a: jnp.ndarray, h: jnp.ndarray, *, gate: str = "", bias: bool = False) -> jnp.ndarray:
    """The attention block's output ``[B, T, H]`` from per-head attention ``a [B, T, Hq, D]``.

    With ``gate`` ``"head"`` or ``"element"`` (Laguna), ``a`` is first multiplied by
    ``softplus(float32(h Wg))`` cast to ``a.dtype``, one factor per head or per element of the
    concatenated heads (``h [B, T, H]`` the normed layer input); then ``@ wo`` (``+ bo`` with ``bias``).
    """
    b, t, hq, d = a.shape
    if gate:
        g = jax.nn.softplus(quant.dot(h, lp["wg"]).astype(jnp.float32)).astype(a.dtype)
        a = (a * g[..., None]).reshape(b, t, hq * d) if gate == "head" else a.reshape(b, t, hq * d) * g
    else:
        a = a.reshape(b, t, hq * d)
    a = quant.dot(a, lp["wo"])
    return a + lp["bo"] if bias else a


def swiglu(x: jnp.ndarray, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, w_gate_t=None,
           w_up_t=None) -> jnp.ndarray:
    """SwiGLU MLP ``down(silu(x @ gate) * (x @ up))``; weights ``[in, out]`` (float or
    :class:`~dflash_jax.nn.quant.QuantizedWeight`, multiplied by :func:`dflash_jax.nn.quant.dot`), optional biases;
    ``w_gate_t``/``w_up_t``: optional ``[out, in]`` copies for wide passes
    (:mod:`dflash_jax.nn.params`)."""
    g = layouts.project(x, w_gate, w_gate_t, layouts.GATE_UP_MIN_ROWS)
    u = layouts.project(x, w_up, w_up_t, layouts.GATE_UP_MIN_ROWS)
    if b_gate is not None:
        g, u = g + b_gate, u + b_up
    y = quant.dot(jax.nn.silu(g) * u, w_down)
    return y if b_down is None else y + b_down


def mlp_residual(lp: dict, x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """``x + swiglu(rms(x; mlp_norm))`` with the layer's SwiGLU weights (and ``b_*`` biases, and
    the ``[out, in]`` copies of :mod:`dflash_jax.nn.params`, when ``lp`` has them)."""
    h = rms_norm(x, lp["mlp_norm"], eps)
    return x + swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"], lp.get("b_gate"), lp.get("b_up"), lp.get("b_down"),
                      w_gate_t=lp.get("w_gate_t"), w_up_t=lp.get("w_up_t"))


def run_layers(body, carry, layers, xs):
    """Runs ``carry = body(carry, layer_params, layer_xs, i)`` over a run of identical layers.

    ``layers`` is either stacked (leaves ``[L, ...]``: one ``lax.scan``, ``i`` a traced int32
    scalar) or the :class:`~dflash_jax.nn.params.PerLayer` of :func:`~dflash_jax.nn.params.unstack_layers`
    (a Python loop over one jitted ``body``, so the layers are traced once, not ``L`` times; ``i`` a
    traced int32 scalar there too). ``xs`` is a pytree of per-layer inputs with leading axis ``L``;
    ``layer_xs`` is its slice at ``i``.
    Returns the final carry. Source: the per-step weight copies of ``lax.scan`` on XLA:CPU
    (BENCHMARKS.md, plain-decoding notes) are why the per-layer form exists."""
    if layouts.is_per_layer(layers):
        layer = jax.jit(body)  # traced once for all layers of one shape (the program still holds L copies)
        for i, lp in enumerate(layers):
            carry = layer(carry, lp, jax.tree_util.tree_map(lambda a, i=i: a[i], xs), jnp.int32(i))
        return carry
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]

    def step(c, inp):
        lp, layer_xs, i = inp
        return body(c, lp, layer_xs, i), None

    return lax.scan(step, carry, (layers, xs, jnp.arange(n, dtype=jnp.int32)))[0]
