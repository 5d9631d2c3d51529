"""Fingerprints of parameter trees: :func:`tree_fingerprint` (names, shapes and float32 values,
the same for stacked and per-layer layouts) and, on it, :func:`weights_fingerprint`, the identity
of a target's weights by which a shipped drafter finds its target.

Two files hold "the same model" when they give the same float32 weights, so the weights'
fingerprint hashes every parameter converted to float32, leaf by leaf in name order. It does not
depend on the file's name or folder, its metadata (a re-saved GGUF with another chat template,
``general.name`` or key order; an HF folder holding the same weights), the layer layout (stacked
or per layer) or the ``[out, in]`` copies of :mod:`dflash_jax.nn.params`; a tied embedding's
output-head copy (:func:`dflash_jax.loading.with_output_head`) is left out. A re-quantized file
is another model: its weights, and the drafts a drafter should make for it, differ. A quantized
weight (:class:`~dflash_jax.nn.quant.QuantizedWeight`) hashes as the float32 weight it stands for,
so one file loaded quantized or float has one fingerprint.

Hashing reads every weight (about 0.4 s for the 135M-parameter default model), so a GGUF target
records its fingerprint in its float32 cache (:mod:`dflash_jax.families.dense.gguf_cache`) when that is
written.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any
import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax.runtime.distributed import fetch
from dflash_jax.nn.params import is_per_layer
from dflash_jax.nn import params as layouts
from dflash_jax.nn import quant

# tables read by row (the embedding gather): a quantized one stands for its rows [V, H], every
# other quantized weight for [..., in, out]
GATHERED = ("embed", "embed_pl")


PREFIX = "f32-sha256:"


class _StackedLeaf:
    """The per-layer buffers of one weight, read as the ``[L, ...]`` leaf they stack to."""

    def __init__(self, parts):
        self.parts = parts


def _values(part, start: int, step: int) -> np.ndarray:
    """``part``'s values from ``start`` every ``step`` (row-major), float32 on the host: all of
    them read in place, or a few strided ones picked on the device (no whole-leaf transfer)."""
    if step == 1 or isinstance(part, np.ndarray):
        return np.ascontiguousarray(np.asarray(part).reshape(-1)[start::step], np.float32)
    return np.asarray(fetch(jnp.ravel(part)[start::step]), np.float32)


def _float(path, w):
    """The float32 array a leaf stands for (a quantized weight dequantized; see GATHERED)."""
    if not quant.is_quantized(w):
        return w
    w32 = w.replace(dtype="float32")
    name = getattr(path[-1], "key", None) if path else None
    return quant.dequantize(w32) if name in GATHERED else w32.dequantized()


def tree_fingerprint(tree, prefix: bytes = b"", samples: int | None = None, digits: int = 16) -> str:
    """sha256 (the first ``digits`` hex digits) of ``prefix`` then, leaf by leaf, each leaf's name
    and shape and its float32 values: all of them, or about ``samples`` evenly strided ones
    (row-major order).

    Per-layer parameters (``"layers"`` a :class:`~dflash_jax.nn.params.PerLayer` of dicts,
    :func:`dflash_jax.nn.params.unstack_layers`) hash as the stacked leaves they stand for, read in place (no stacked copy), so both layouts
    of one model have one fingerprint, and so do trees with and without the ``[out, in]`` copies of
    :mod:`dflash_jax.nn.params`. Leaves may be numpy or JAX arrays of any float dtype, or quantized
    weights (hashed as the float32 weights they stand for, one at a time)."""
    tree = layouts.canonical(tree)
    layers = tree.get("layers") if isinstance(tree, dict) else None
    if is_per_layer(layers):
        tree = dict(tree, layers=jax.tree_util.tree_map(lambda *a: _StackedLeaf(a), *layers, is_leaf=quant.is_quantized))
    h = hashlib.sha256(prefix)
    for k, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=quant.is_quantized):
        parts = v.parts if isinstance(v, _StackedLeaf) else (v,)
        first = _float(k, parts[0])
        shape = ((len(parts),) if isinstance(v, _StackedLeaf) else ()) + tuple(np.shape(first))
        size = math.prod(shape)
        step = 1 if samples is None else max(1, size // samples)
        h.update(f"{jax.tree_util.keystr(k)}{shape}".encode())
        for i, part in enumerate(parts):  # the stacked leaf's strided samples that fall in layer i
            h.update(_values(first if i == 0 else _float(k, part), (-i * (size // len(parts))) % step, step))
    return h.hexdigest()[:digits]


def weights_fingerprint(cfg: Any, params: Any) -> str:
    """``"f32-sha256:<64 hex digits>"``: :func:`tree_fingerprint` of all of a target's weights
    (see the module docstring).

    Args:
      cfg: the target config (``tie_word_embeddings`` says whether ``params["lm_head"]``, when
        present, is a derived copy to leave out).
      params: the target's parameter pytree (numpy or JAX leaves, layers stacked or per layer).
    """
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    weights = {k: v for k, v in params.items() if not (tied and k == "lm_head")}
    return PREFIX + tree_fingerprint(weights, digits=64)
