"""Test helper: a float parameter tree with its matrix weights replaced by Q8_0
:class:`~dflash_jax.nn.quant.QuantizedWeight` leaves, and the float tree those stand for.

Q8_0 as GGUF stores it (one float16 scale ``d = max|x| / 127`` per 32 inputs of a row, int8 codes
``round(x / d)``); the float stand-in is ``codes * d`` in float32, which is what the model must
compute with, so a quantized forward must equal the float forward of the stand-ins.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.nn import quant_gguf  # noqa: F401  (registers q8_0)
from dflash_jax.nn.quant import QuantizedWeight

# leaves multiplied as [..., in, out]; gathered tables [V, H] (stored as V rows of H)
MATRICES = {"wq", "wk", "wv", "wo", "wg", "w_gate", "w_up", "w_down", "router", "e_gate", "e_up", "e_down", "s_gate", "s_up",
            "s_down", "s_router", "lm_head", "fc", "pl_proj", "pl_gate", "pl_out", "wz", "wb", "wa"}
TABLES = {"embed", "embed_pl"}


def q8_0_rows(rows: np.ndarray) -> tuple[dict, np.ndarray]:
    """``rows [..., out, in]`` float -> (Q8_0 fields, float32 stand-in ``[..., out, in]``)."""
    x = np.asarray(rows, np.float32)
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
    d = (np.abs(g).max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    codes = np.round(np.divide(g, d32[..., None], out=np.zeros_like(g), where=d32[..., None] != 0)).astype(np.int8)
    back = (codes.astype(np.float32) * d32[..., None]).reshape(x.shape)
    return {"codes": codes.reshape(x.shape), "scale": d}, back


def quantize_tree(params, skip=(), dtype: str = "float32"):
    """``(quantized tree, float tree)``: every :data:`MATRICES` / :data:`TABLES` leaf whose input
    width is a multiple of 32 (and whose name is not in ``skip``) becomes Q8_0 in the first and its
    float32 stand-in in the second; other leaves are the same arrays in both."""
    def one(path, a):
        name = getattr(path[-1], "key", None)
        if name in skip or name not in MATRICES | TABLES or np.ndim(a) < 2:
            return a, a
        table = name in TABLES
        rows = np.asarray(a) if table else np.swapaxes(np.asarray(a), -1, -2)
        if rows.shape[-1] % 32:
            return a, a
        fields, back = q8_0_rows(rows)
        flt = back if table else np.swapaxes(back, -1, -2)
        return (QuantizedWeight({k: jnp.asarray(v) for k, v in fields.items()}, "q8_0", dtype),
                jnp.asarray(flt, jnp.dtype(dtype)))

    pairs = jax.tree_util.tree_map_with_path(one, params)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and not isinstance(x[0], (tuple, str))  # noqa: E731
    q = jax.tree_util.tree_map(lambda p: p[0], pairs, is_leaf=is_pair)
    f = jax.tree_util.tree_map(lambda p: p[1], pairs, is_leaf=is_pair)
    return q, f


def count_quantized(tree) -> int:
    return sum(isinstance(x, QuantizedWeight) for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight)))

