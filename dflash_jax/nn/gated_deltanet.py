"""Gated DeltaNet (linear attention with a gated delta-rule memory) as pure functions.

The math of transformers ``modeling_qwen3_5.py`` (``Qwen3_5GatedDeltaNet``,
``causal_conv1d_fn`` / ``causal_conv1d_update``, ``l2norm``, ``torch_recurrent_gated_delta_rule``,
``Qwen3_5RMSNormGated``), written for a fixed-shape carry:

* the causal depthwise convolution reads a *window* ``[conv state (K-1 rows) | new inputs]``, so
  a chunk, a verify block and one decode token are the same computation; the state after the
  first ``n`` new inputs is rows ``[n, n + K - 1)`` of that window (:func:`conv_state_after`);
* decode steps and verify blocks run the recurrence token by token (:func:`gated_delta_scan`, a
  ``lax.scan`` in float32, exactly the recurrent rule, and the state after every position is
  there for a verify to keep); prefill chunks run the chunked form (:func:`gated_delta_chunked`,
  as transformers prefills: ``T / 64`` sequential steps of matrix products instead of ``T``
  rank-1 updates), equal up to float32 rounding (the oracle tests bound it);
* positions flagged invalid (padding past a row's prompt, or past the capacity) leave the state
  unchanged, and the scan can return the state after every position (what a verify keeps so that
  a rejected suffix rolls back exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def l2_normalize(x: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    """``x * rsqrt(sum(x^2, -1) + eps)`` in float32 (transformers ``l2norm``, the FLA convention)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(window: jnp.ndarray, weight: jnp.ndarray) -> jnp.ndarray:
    """SiLU of the causal depthwise convolution over a window.

    Args:
      window: ``[B, K - 1 + T, C]``: the previous ``K - 1`` inputs (the conv state), then ``T`` new ones.
      weight: ``[K, C]`` taps (transformers' ``conv1d.weight[c, 0, i]`` is ``weight[i, c]``; tap
        ``K - 1`` multiplies the newest input).
    Returns:
      ``[B, T, C]`` float32: ``silu(sum_i weight[i] * window[t + i])`` for each new input ``t``.
    Source: transformers ``causal_conv1d_fn`` / ``causal_conv1d_update`` (no bias in Qwen3.5).
    """
    k = weight.shape[0]
    t = window.shape[1] - k + 1
    w = weight.astype(jnp.float32)
    x = window.astype(jnp.float32)
    out = sum(x[:, i : i + t] * w[i] for i in range(k))
    return jax.nn.silu(out)


def conv_state_after(window: jnp.ndarray, n: jnp.ndarray, taps: int) -> jnp.ndarray:
    """The conv state after the first ``n[b]`` new inputs of each row: rows ``[n, n + taps - 1)``
    of ``window [B, taps - 1 + T, C]`` (``n [B]`` int32 in ``[0, T]``; ``n = 0``: the old state).
    Returns ``[B, taps - 1, C]`` in ``window.dtype``."""
    idx = n[:, None] + jnp.arange(taps - 1, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(window, idx[:, :, None], axis=1)


def gated_delta_scan(q, k, v, g, beta, state, valid, keep_states: bool = False):
    """The gated delta rule, token by token, from ``state``.

    Per token (heads independent): ``S *= exp(g)``; ``S += k (beta (v - S^T k))^T``; output
    ``S^T q``. Invalid tokens leave ``S`` unchanged (their outputs are unused).

    Args:
      q, k: ``[B, T, Hv, dk]`` float32, already L2-normalised, repeated to the value heads, and
        ``q`` scaled by ``dk ** -0.5``.
      v: ``[B, T, Hv, dv]``; g, beta: ``[B, T, Hv]`` float32 (log decay, write strength).
      state: ``[B, Hv, dk, dv]`` float32 recurrent state before the first token.
      valid: ``[B, T]`` bool.
      keep_states: also return the state after every token.
    Returns:
      ``(out [B, T, Hv, dv] float32, final state [B, Hv, dk, dv], states [T, B, Hv, dk, dv] or None)``.
    Source: transformers ``torch_recurrent_gated_delta_rule``.
    """
    v = v.astype(jnp.float32)

    def step(s, xs):
        qt, kt, vt, gt, bt, ok = xs
        s1 = s * jnp.exp(gt)[..., None, None]
        mem = jnp.einsum("bhkv,bhk->bhv", s1, kt)
        s1 = s1 + kt[..., :, None] * ((vt - mem) * bt[..., None])[..., None, :]
        out = jnp.einsum("bhkv,bhk->bhv", s1, qt)
        s1 = jnp.where(ok[:, None, None, None], s1, s)
        return s1, ((out, s1) if keep_states else (out, None))

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, valid))
    final, (out, states) = lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1), final, states


def gated_delta_chunked(q, k, v, g, beta, state, valid, chunk: int = 64):
    """The gated delta rule over chunks of ``chunk`` tokens: same arguments and result as
    :func:`gated_delta_scan` without ``keep_states`` (``states`` is None), equal up to float32 rounding.

    Within a chunk starting from state ``S0``, with ``c = cumsum(g)`` (``G[t, s] = exp(c_t - c_s)``
    for ``s <= t``), the values written ``U`` solve the unit lower-triangular system
    ``(I + A) U = beta v - beta exp(c) k S0`` with ``A[t, s] = beta_t G[t, s] k_t . k_s`` (``s < t``);
    then ``out = exp(c) q S0 + (G o q k^T) U`` and ``S = exp(c_end) S0 + (G[end] k)^T U``: ``T / chunk``
    sequential steps of matrix products instead of ``T`` rank-1 updates. Invalid tokens get
    ``g = 0`` and ``beta = 0``, so they write nothing and decay nothing.
    Source: the chunked form (UT transform) of transformers ``torch_chunk_gated_delta_rule``.
    """
    b, t, h, _ = k.shape
    c = min(chunk, t)
    pad = (-t) % c
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, -1, c) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    cum = jnp.cumsum(g, axis=-1)
    incl = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(incl, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    a = beta[..., None] * jnp.einsum("...td,...sd->...ts", k, k) * jnp.where(incl & ~jnp.eye(c, dtype=bool), decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k * (beta * jnp.exp(cum))[..., None]], axis=-1)
    sol = lax.linalg.triangular_solve(a + jnp.eye(c, dtype=a.dtype), rhs, left_side=True, lower=True, unit_diagonal=True)
    dv = v.shape[-1]
    xs = (sol[..., :dv], sol[..., dv:], jnp.einsum("...td,...sd->...ts", q, k) * decay, q * jnp.exp(cum)[..., None],
          k * jnp.exp(cum[..., -1:] - cum)[..., None], jnp.exp(cum[..., -1]))

    def step(s, x):
        w, kc, qk, qg, kend, gend = x
        u = w - jnp.einsum("bhcd,bhde->bhce", kc, s)
        out = jnp.einsum("bhcd,bhde->bhce", qg, s) + jnp.einsum("bhts,bhse->bhte", qk, u)
        return s * gend[..., None, None] + jnp.einsum("bhcd,bhce->bhde", kend, u), out

    final, out = lax.scan(step, state.astype(jnp.float32), xs)
    out = jnp.moveaxis(out, 0, 1).transpose(0, 1, 3, 2, 4).reshape(b, -1, h, dv)
    return out[:, :t], final, None


def gated_rms_norm(x: jnp.ndarray, weight: jnp.ndarray, gate: jnp.ndarray, eps: float) -> jnp.ndarray:
    """``weight * x / sqrt(mean(x^2) + eps) * silu(gate)`` over the last axis, statistics and gate
    in float32, returned in ``gate.dtype`` (x ``[..., dv]``, weight ``[dv]``, gate like x).
    Source: transformers ``Qwen3_5RMSNormGated`` (norm before gate; plain weight, not ``1 + w``)."""
    dtype = gate.dtype
    x = x.astype(jnp.float32)
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y = y.astype(dtype) * weight.astype(dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)
