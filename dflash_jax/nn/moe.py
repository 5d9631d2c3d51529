"""The softmax-routed mixture of SwiGLU experts with a gated shared expert (Qwen3-Next).

Per token ``x [H]``: ``p = softmax(float32(x Wr))`` over ``E`` experts; the top ``k`` of ``p``
(renormalised to sum 1 when ``norm_topk``), cast to ``x.dtype``, weight the chosen experts'
SwiGLU outputs; plus the shared expert's SwiGLU output times ``sigmoid(x Ws)`` (one scalar per
token). Only the chosen experts run: the ``N*k`` (token, expert) pairs are sorted by expert and
go through ``jax.lax.ragged_dot`` with per-expert group sizes.
Source: transformers ``modeling_qwen3_next.py`` (``Qwen3NextTopKRouter``, ``Qwen3NextExperts``,
``Qwen3NextSparseMoeBlock``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dflash_jax.nn.attention import swiglu


def softmax_moe(lp: dict, h: jnp.ndarray, top_k: int, norm_topk: bool) -> jnp.ndarray:
    """The MoE block on ``h [..., H]`` -> ``[..., H]`` in ``h.dtype`` (module docstring).

    Args:
      lp: ``router [H, E]``, ``e_gate``/``e_up [E, H, Im]``, ``e_down [E, Im, H]``,
        ``s_gate``/``s_up [H, Is]``, ``s_down [Is, H]``, ``s_router [H, 1]``.
      h: the normed layer input.
      top_k: experts per token; norm_topk: renormalise the chosen probabilities.
    """
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    n_exp = lp["router"].shape[-1]
    probs = jax.nn.softmax((x @ lp["router"]).astype(jnp.float32), axis=-1)
    w, idx = lax.top_k(probs, top_k)
    if norm_topk:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    w = w.astype(x.dtype)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // top_k
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    xs = jnp.take(x, tok, axis=0)
    y = lax.ragged_dot(jax.nn.silu(lax.ragged_dot(xs, lp["e_gate"], sizes)) * lax.ragged_dot(xs, lp["e_up"], sizes), lp["e_down"], sizes)
    y = y * jnp.take(w.reshape(-1), order)[:, None]
    routed = jnp.zeros_like(x).at[tok].add(y.astype(x.dtype))
    shared = swiglu(x, lp["s_gate"], lp["s_up"], lp["s_down"]) * jax.nn.sigmoid(x @ lp["s_router"])
    return (routed + shared).reshape(shape)
