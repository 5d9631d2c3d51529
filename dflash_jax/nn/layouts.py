"""``[out, in]`` copies of weights that XLA:CPU multiplies faster that way in wide passes.

The models hold their weights ``[in, out]`` and multiply ``x @ W``. Timed alone
(``tools/bench_layout.py``, BENCHMARKS.md "Weight layout against pass width"), XLA:CPU multiplies
the MLP's gate and up projections about 1.26x faster from 2 rows (``B * T``) on, and the LM head
about 1.22x faster from 3 rows on, with the weight held ``[out, in]`` as ``W x^T``; one row, and
q, k, v, o and down at every width, prefer ``[in, out]``.

So a dense target can hold both: its weights, and ``[out, in]`` copies
(:func:`with_wide_layouts`); each matmul picks by its static row count (:func:`project`), with
the same values (float32 sums in another order). Whether a whole pass gets faster,
``tools/bench_layout.py --passes`` times the real forward with and without the copies
(BENCHMARKS.md, "Weight layout in a whole target pass"): on XLA:CPU the gate/up copies make it
slower and only the LM head's pays (about 4 % from 3 rows on). So on the CPU backend
:func:`dflash_jax.loading.load_target` adds :data:`CPU_KINDS` (for the tied default target the
copy is the embedding itself: no memory); fingerprints hash :func:`canonical` trees and
:func:`dflash_jax.sharding.param_shardings` places the copies by :func:`with_wide_axes`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dflash_jax.models.params import PerLayer, is_per_layer

GATE_UP_MIN_ROWS = 2  # gate/up from this many rows (B * T) on use their [out, in] copies
HEAD_MIN_ROWS = 3  # the LM head from this many rows on uses its [out, in] copy
KINDS = ("gate_up", "lm_head")
# What the loaders add on XLA:CPU: a whole pass measured faster only with the LM head's copy
# (about 1.04x from 3 rows on; the gate/up copies made it 1-15 % slower), BENCHMARKS.md
# "Weight layout in a whole target pass".
CPU_KINDS = ("lm_head",)


def _swap(a):
    """``a`` with its last two axes swapped, in a buffer of its own (numpy or JAX)."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(np.swapaxes(a, -1, -2))
    return jnp.asarray(jnp.swapaxes(a, -1, -2))


def _each_layer(layers, f):
    """``f`` applied to every layer dict: the :class:`PerLayer` ones, or the one stacked dict."""
    return PerLayer(f(lp) for lp in layers) if is_per_layer(layers) else f(layers)


def with_wide_layouts(params: dict, kinds=KINDS, tied: bool = False) -> dict:
    """``params`` of a dense target plus ``[out, in]`` copies for wide passes.

    Args:
      params: a dense target's pytree (:mod:`dflash_jax.models.dense`), layers stacked
        (``[L, H, I]`` leaves) or per layer; numpy or JAX leaves.
      kinds: which copies, of :data:`KINDS`: ``"gate_up"`` adds ``w_gate_t`` and ``w_up_t``
        (``[I, H]``, or ``[L, I, H]`` stacked) to every layer, ``"lm_head"`` adds
        ``lm_head_t [V, H]`` (none without ``lm_head``: a tied embedding is ``[V, H]`` already).
      tied: ``lm_head`` is a copy of the embedding (:func:`dflash_jax.loading.with_output_head`):
        ``lm_head_t`` is then the embedding itself, no new buffer.
    Returns:
      the tree with those copies (the models use them from :data:`GATE_UP_MIN_ROWS` and
      :data:`HEAD_MIN_ROWS` rows on).
    Raises:
      ValueError: a kind not in :data:`KINDS`.
    """
    if set(kinds) - set(KINDS):
        raise ValueError(f"kinds: got {sorted(set(kinds) - set(KINDS))}, expected some of {KINDS}")
    out = dict(params)
    if "gate_up" in kinds:
        out["layers"] = _each_layer(params["layers"], lambda lp: dict(lp, w_gate_t=_swap(lp["w_gate"]), w_up_t=_swap(lp["w_up"])))
    if "lm_head" in kinds and "lm_head" in params:  # without it the tied embedding [V, H] is the head already
        out["lm_head_t"] = params["embed"] if tied else _swap(params["lm_head"])
    return out


def canonical(tree):
    """``tree`` without the copies of :func:`with_wide_layouts` (any other tree as it is): what
    fingerprints hash."""
    if not isinstance(tree, dict) or not (isinstance(tree.get("layers"), dict) or is_per_layer(tree.get("layers"))):
        return tree
    layers = _each_layer(tree["layers"], lambda lp: {k: v for k, v in lp.items() if k not in ("w_gate_t", "w_up_t")})
    return {k: (layers if k == "layers" else v) for k, v in tree.items() if k != "lm_head_t"}


def with_wide_axes(axes: dict, params: dict) -> dict:
    """The logical axes of ``params`` from its model's ``param_axes`` tree ``axes``, adding those of
    the copies ``params`` holds and ``axes`` does not name: these copies, and a tied embedding's
    ``lm_head [H, V]`` (:func:`dflash_jax.loading.with_output_head`); a copy has its weight's axes
    in the other order."""
    if not isinstance(params, dict) or not isinstance(axes, dict) or "layers" not in params:
        return axes
    out = dict(axes)
    if "lm_head" in params and "lm_head" not in out and "embed" in out:
        out["lm_head"] = out["embed"][::-1]
    if "lm_head_t" in params and "lm_head_t" not in out and "lm_head" in out:
        out["lm_head_t"] = out["lm_head"][::-1]

    def add(lp, la):
        return dict(la, **{k: la[k[:-2]][:-2] + la[k[:-2]][:-3:-1] for k in ("w_gate_t", "w_up_t") if k in lp and k not in la})

    layers, la = params["layers"], axes.get("layers")
    if is_per_layer(layers) and is_per_layer(la) and len(la) == len(layers):
        out["layers"] = PerLayer(add(lp, a) for lp, a in zip(layers, la))
    elif isinstance(layers, dict) and isinstance(la, dict):
        out["layers"] = add(layers, la)
    return out


def project(x: jnp.ndarray, w, wt, min_rows: int, preferred_element_type=None) -> jnp.ndarray:
    """``x [..., in] @ w [in, out]`` -> ``[..., out]``, computed as ``wt x^T`` with the copy
    ``wt [out, in]`` instead when there is one (not ``None``) and ``x`` has at least ``min_rows``
    rows (the product of its leading dims, static). The expression is the one
    ``tools/bench_layout.py`` timed; ``preferred_element_type`` as in ``jnp.einsum``."""
    rows = math.prod(x.shape[:-1])
    if wt is None or rows < min_rows:
        if preferred_element_type is None:
            return x @ w
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=preferred_element_type)
    y = jnp.einsum("oi,ri->ro", wt, x.reshape(rows, x.shape[-1]), preferred_element_type=preferred_element_type)
    return y.reshape(x.shape[:-1] + (wt.shape[0],))
