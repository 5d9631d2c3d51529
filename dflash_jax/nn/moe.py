"""Routed experts shared by the MoE families (Laguna, Qwen3-MoE, gpt-oss, Qwen3-Next): only the
chosen experts run.

The ``N*k`` (token, expert) pairs are sorted by expert and run through ``jax.lax.ragged_dot``
with per-expert group sizes, then scattered back weighted by their routing weights.

Quantized expert stacks (:class:`~dflash_jax.nn.quant.QuantizedWeight`, fields ``[E, out, k]``):
when the pairs are fewer than the experts (``N*k < E``: decode and short verify passes of a model
with many experts), only the chosen experts' fields are gathered and dequantized, one weight per
pair, and each pair multiplies its own; otherwise (prefill) the whole stack is dequantized inside
the computation for the ragged matmul. So a step never holds more than ``min(N*k, E)`` experts in
float.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from dflash_jax.nn import quant
from dflash_jax.nn.layer import swiglu


def silu_glu(g: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
    """The SwiGLU of Qwen3-MoE and Laguna experts: ``silu(g) * u``."""
    return jax.nn.silu(g) * u


def clamped_glu(limit: float, alpha: float):
    """gpt-oss's clamped SwiGLU ``(clip(u, -limit, limit) + 1) * g' * sigmoid(alpha g')`` with
    ``g' = min(g, limit)`` (transformers ``GptOssExperts._apply_gate``)."""

    def act(g, u):
        g = jnp.minimum(g, limit)
        return (jnp.clip(u, -limit, limit) + 1) * (g * jax.nn.sigmoid(g * alpha))

    return act


def _expert_matmul(xs: jnp.ndarray, w, sizes: jnp.ndarray, pair_e: jnp.ndarray) -> jnp.ndarray:
    """``xs [P, in]`` (pairs sorted by expert) times each pair's expert of ``w [E, in, out]`` ->
    ``[P, out]``: ``ragged_dot`` over a float stack; a quantized stack dequantized whole when
    ``P >= E``, else only the ``P`` chosen experts ``pair_e [P]`` (module docstring)."""
    if not quant.is_quantized(w):
        return lax.ragged_dot(xs, w, sizes)
    if xs.shape[0] >= w.lead[0]:
        w, xs = quant.tied(w, xs)
        return lax.ragged_dot(xs, w.dequantized().astype(xs.dtype), sizes)
    fields = {k: jnp.take(a, pair_e, axis=0) for k, a in w.fields.items()}
    chosen = quant.dequantize(w.replace(fields=fields))  # [P, out, in]
    return jnp.einsum("pi,poi->po", xs, chosen.astype(xs.dtype))


def routed_experts(x: jnp.ndarray, idx: jnp.ndarray, w: jnp.ndarray, e_gate, e_up, e_down, *, biases=None,
                   act=silu_glu) -> jnp.ndarray:
    """``sum_j w[n, j] * expert_{idx[n, j]}(x[n])`` with gated experts
    ``down(act(x gate + b_gate, x up + b_up)) + b_down``.

    Args:
      x: ``[N, H]`` tokens.
      idx: ``[N, k]`` int chosen expert ids in ``[0, E)``.
      w: ``[N, k]`` routing weights (cast to ``x.dtype`` by the caller).
      e_gate, e_up: ``[E, H, I]``; e_down: ``[E, I, H]`` (``[in, out]`` per expert): float
        arrays or :class:`~dflash_jax.nn.quant.QuantizedWeight` stacks (module docstring).
      biases: optional ``(b_gate [E, I], b_up [E, I], b_down [E, H])`` (gpt-oss).
      act: ``(gate, up) -> hidden`` (:func:`silu_glu`; :func:`clamped_glu` for gpt-oss).
    Returns:
      ``[N, H]`` in ``x.dtype``. Source: transformers ``Qwen3MoeExperts.forward`` /
      ``LagunaExperts`` / ``GptOssExperts`` (a loop over hit experts), computed here as one
      sorted ragged matmul.
    """
    k, n_experts = idx.shape[-1], e_gate.shape[0]
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat_e, length=n_experts).astype(jnp.int32)
    row_e = jnp.take(flat_e, order)
    xs = jnp.take(x, tok, axis=0)
    g = _expert_matmul(xs, e_gate, sizes, row_e)
    u = _expert_matmul(xs, e_up, sizes, row_e)
    if biases is not None:
        g, u = g + jnp.take(biases[0], row_e, axis=0), u + jnp.take(biases[1], row_e, axis=0)
    y = _expert_matmul(act(g, u), e_down, sizes, row_e)
    if biases is not None:
        y = y + jnp.take(biases[2], row_e, axis=0)
    y = y * jnp.take(w.reshape(-1), order)[:, None]
    return jnp.zeros_like(x).at[tok].add(y.astype(x.dtype))


def softmax_top_k(logits: jnp.ndarray, k: int, renormalise: bool) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The Qwen routers: ``softmax`` over all experts in float32, its top ``k`` (weights
    renormalised to sum 1 when ``renormalise``: ``norm_topk_prob``). Returns ``(w [N, k] float32,
    idx [N, k] int32)``. Source: transformers ``Qwen3MoeTopKRouter`` / ``Qwen3NextTopKRouter``."""
    w, idx = lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), k)
    return (w / jnp.sum(w, axis=-1, keepdims=True) if renormalise else w), idx


def softmax_moe(lp: dict, h: jnp.ndarray, top_k: int, norm_topk: bool) -> jnp.ndarray:
    """Qwen3-Next's MoE block on ``h [..., H]`` -> ``[..., H]`` in ``h.dtype``: the routed
    SwiGLU experts (:func:`softmax_top_k`, :func:`routed_experts`) plus a shared SwiGLU expert
    times ``sigmoid(x Ws)`` (one gate per token).

    Args:
      lp: ``router [H, E]``, ``e_gate``/``e_up [E, H, Im]``, ``e_down [E, Im, H]``,
        ``s_gate``/``s_up [H, Is]``, ``s_down [Is, H]``, ``s_router [H, 1]``.
      h: the normed layer input; top_k: experts per token; norm_topk: renormalise the chosen weights.
    Source: transformers ``modeling_qwen3_next.py`` ``Qwen3NextSparseMoeBlock``.
    """
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    w, idx = softmax_top_k(quant.dot(x, lp["router"]), top_k, norm_topk)
    routed = routed_experts(x, idx, w.astype(x.dtype), lp["e_gate"], lp["e_up"], lp["e_down"])
    shared = swiglu(x, lp["s_gate"], lp["s_up"], lp["s_down"]) * jax.nn.sigmoid(quant.dot(x, lp["s_router"]))
    return (routed + shared).reshape(shape)
