"""Quantized weights kept quantized: one pytree type and the matrix-multiply entry point every model calls.

**The type.** :class:`QuantizedWeight` holds a weight the way its checkpoint stores it: integer (or
FP8) codes plus per-group scales and offsets, in named ``fields``, and the name of its
:class:`QuantFormat` (static metadata, part of a jitted function's cache key). The fields keep the
checkpoint's row order: output features first, the groups running along the input dimension
(``[..., out, ...]``), so a stacked layer axis ``L`` or an expert axis ``E`` leads every field and
``lax.scan`` slices a stacked weight like an array. The weight it stands for is ``[..., in, out]``
(the models' ``x @ W`` convention); :attr:`QuantizedWeight.shape` reports that shape.

**The entry point.** :func:`dot` multiplies ``x @ W`` for a float array and for a
:class:`QuantizedWeight` alike; the latter is dequantized inside the jitted computation
(:func:`dequantize`), where XLA fuses the dequantization into the product. ``x @ qw`` also works
(``__rmatmul__``), so model code written with ``@`` takes quantized weights unchanged.
:func:`take_rows` is the embedding gather: it dequantizes only the gathered rows.

**Formats** register a :class:`QuantFormat`: how many weights a group holds along the input
dimension and how to turn the fields into float ``[..., out, in]``. The GGUF block formats
(Q4_0..Q8_0, Q2_K..Q6_K, MXFP4) are in :mod:`dflash_jax.nn.quant_gguf`, registered when that module
is imported (the GGUF loaders import it through :mod:`dflash_jax.formats.gguf_quant`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax.errors import DFlashError
from dflash_jax.runtime import carry as pytree


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One quantization format.

    Attributes:
      name: the registry key (``"q8_0"``, ``"q4_k"``, ``"mxfp4"``, ``"fp8_block"``, ``"int8"``, ...).
      in_features: ``fields -> int``, the input dimension of the weight the fields stand for.
      dequantize: ``(fields, dtype) -> [..., out, in]`` float array in ``dtype``; exact (the
        float the checkpoint's own dequantizer gives, up to float rounding of ``dtype``).
      rows: ``(fields, index) -> fields`` of the output rows ``index`` (any int array shape);
        used by :func:`take_rows` (the embedding gather). ``None``: slice every field's ``out`` axis.
    """

    name: str
    in_features: Callable
    dequantize: Callable
    rows: Callable | None = None


FORMATS: dict[str, QuantFormat] = {}


def register(fmt: QuantFormat) -> QuantFormat:
    """Adds ``fmt`` to :data:`FORMATS` (module import time); returns it."""
    FORMATS[fmt.name] = fmt
    return fmt


def format_of(name: str) -> QuantFormat:
    """The registered format ``name``. Raises DFlashError naming the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise DFlashError("quantized weight", f"unknown format {name!r}", " / ".join(sorted(FORMATS))) from None


@pytree.dataclass
class QuantizedWeight:
    """A quantized ``[..., in, out]`` weight (module docstring).

    Attributes:
      fields: named arrays, each shaped ``[*lead, out, k]``: the weight's leading (layer, expert)
        axes, its output rows, and ``k`` values per row (packed codes, or one scale per group:
        a scale shared by a block of rows is repeated per row). Every format has ``"codes"``;
        the other names and the dtypes are the format's business.
      format: the :class:`QuantFormat` name (static).
      dtype: the float dtype the weight computes in (static; the model's dtype).
    """

    fields: dict
    format: str = pytree.field(pytree_node=False)
    dtype: str = pytree.field(pytree_node=False, default="float32")

    @property
    def lead(self) -> tuple:
        """The leading (layer, expert) axes every field shares, before ``out``."""
        return self.fields["codes"].shape[:-2]

    @property
    def out_features(self) -> int:
        return self.fields["codes"].shape[-2]

    @property
    def shape(self) -> tuple:
        """``(*lead, in, out)``: the shape of the float weight this stands for."""
        return (*self.lead, format_of(self.format).in_features(self.fields), self.out_features)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the fields take (device memory of this weight)."""
        return sum(int(a.size) * a.dtype.itemsize for a in self.fields.values())

    def dequantized(self) -> jnp.ndarray:
        """The float weight ``[..., in, out]`` in :attr:`dtype`."""
        return jnp.swapaxes(dequantize(self), -1, -2)

    def __rmatmul__(self, x):
        return dot(x, self)


def dequantize(w: QuantizedWeight) -> jnp.ndarray:
    """``w`` as float ``[..., out, in]`` (the checkpoint's row order) in ``w.dtype``."""
    return format_of(w.format).dequantize(w.fields, jnp.dtype(w.dtype))


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def dot(x: jnp.ndarray, w, preferred_element_type=None) -> jnp.ndarray:
    """``x [..., in] @ w [in, out]`` -> ``[..., out]``: the one matrix multiply of every model.

    ``w`` is a float array (``x @ w``, unchanged) or a 2-D :class:`QuantizedWeight`, dequantized
    inside the traced computation to ``[out, in]`` and contracted as ``x W^T`` so XLA can fuse
    the dequantization into the product. ``preferred_element_type`` as in ``jnp.einsum``.
    Raises DFlashError on a stacked (3-D or more) quantized weight: slice it first.
    """
    if not isinstance(w, QuantizedWeight):
        if preferred_element_type is None:
            return x @ w
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=preferred_element_type)
    if w.lead:
        raise DFlashError("quantized weight", f"dot takes a 2-D weight, got leading axes {w.lead}", "one layer's weight")
    wt = dequantize(w).astype(x.dtype)
    if math.prod(x.shape[:-1]) == 1 and jax.default_backend() == "cpu":
        # One row (a decode step): XLA:CPU fuses the dequantization into a slow scalar matrix-vector
        # loop; dequantized first, [in, out], behind a barrier, the product runs 2.2x faster
        # (tools/bench_quant_dot.py, BENCHMARKS.md "Quantized weights against float (CPU)"). Measured
        # on XLA:CPU only: other backends keep the fused product.
        w_io = jax.lax.optimization_barrier(jnp.swapaxes(wt, -1, -2))
        return jnp.einsum("...i,io->...o", x, w_io, preferred_element_type=preferred_element_type)
    return jnp.einsum("...i,oi->...o", x, wt, preferred_element_type=preferred_element_type)


def take_rows(w, index: jnp.ndarray) -> jnp.ndarray:
    """The embedding gather: rows ``index`` (int array, any shape) of an embedding ``w [V, H]``
    -> ``[*index.shape, H]``. A quantized embedding is stored as ``V`` output rows of ``H`` inputs
    (GGUF's ``token_embd``), so only the gathered rows are dequantized."""
    if not isinstance(w, QuantizedWeight):
        return jnp.take(w, index, axis=0)
    fmt = format_of(w.format)
    if fmt.rows is not None:
        fields = fmt.rows(w.fields, index)
    else:
        fields = {k: jnp.take(a, index, axis=0) for k, a in w.fields.items()}
    return fmt.dequantize(fields, jnp.dtype(w.dtype))


def output_rows(w, index: jnp.ndarray):
    """The output columns ``index [n]`` (int) of a ``[..., in, out]`` weight -> ``[..., in, n]``:
    ``jnp.take(w, index, axis=-1)`` of a float array; of a :class:`QuantizedWeight`, the same rows
    of its fields (still quantized; a draft vocabulary's head columns)."""
    if not isinstance(w, QuantizedWeight):
        return jnp.take(w, index, axis=-1)
    fmt = format_of(w.format)
    if fmt.rows is not None and not w.lead:
        return w.replace(fields=fmt.rows(w.fields, index))
    return w.replace(fields={k: jnp.take(a, index, axis=-2) for k, a in w.fields.items()})


def astype(w, dtype):
    """``w`` computing in ``dtype``: a float array cast; a :class:`QuantizedWeight` relabelled
    (it dequantizes straight to ``dtype``; the fields are not copied)."""
    if isinstance(w, QuantizedWeight):
        return w.replace(dtype=jnp.dtype(dtype).name)
    return w.astype(dtype)
