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
import functools
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
      parts: ``n_in -> int``, how many equal runs of input columns an XLA:CPU product splits into, each
        dequantized on its own (``dequantize(fields, dtype, cols=(lo, hi))`` -> ``[..., out, hi - lo]``):
        runs over which the fields read affinely, so XLA:CPU fuses each run's dequantization into a
        vectorized loop (the GGUF formats' bit planes, :mod:`dflash_jax.nn.quant_gguf`). 1: whole.
    """

    name: str
    in_features: Callable
    dequantize: Callable
    rows: Callable | None = None
    parts: Callable = lambda n_in: 1


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


def tied(w: QuantizedWeight, x):
    """``(w, x)`` passed through one optimization barrier, so ``w``'s dequantization depends on
    ``x`` and stays where it is used.

    Without it, XLA's while-loop invariant code motion hoists the dequantization of every weight
    out of an on-device decode loop: the loop then carries the float weights (the memory quantized
    weights exist to save; on XLA:CPU a 30-layer decode step also ran 8x slower).
    tests/test_quant_gguf.py checks a loop's carried arrays. (It does not stop XLA:CPU's fusion
    of ``x``'s producer into a product: barriers are gone by then; :func:`dot` uses a conditional.)"""
    fields, x = jax.lax.optimization_barrier((w.fields, x))
    return w.replace(fields=fields), x


def dot(x: jnp.ndarray, w, preferred_element_type=None) -> jnp.ndarray:
    """``x [..., in] @ w [in, out]`` -> ``[..., out]``: the one matrix multiply of every model.

    ``w`` is a float array (``x @ w``, unchanged) or a 2-D :class:`QuantizedWeight`, dequantized
    inside the traced computation to ``[out, in]`` and contracted as ``x W^T`` so XLA can fuse
    the dequantization into the product (on XLA:CPU run by run of input columns,
    :func:`_cpu_product`). ``preferred_element_type`` as in ``jnp.einsum``.
    Raises DFlashError on a stacked (3-D or more) quantized weight: slice it first.
    """
    if not isinstance(w, QuantizedWeight):
        if preferred_element_type is None:
            return x @ w
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=preferred_element_type)
    if w.lead:
        raise DFlashError("quantized weight", f"dot takes a 2-D weight, got leading axes {w.lead}", "one layer's weight")
    if jax.default_backend() != "cpu" or x.size == 0:
        w, x = tied(w, x)
        return jnp.einsum("...i,oi->...o", x, dequantize(w).astype(x.dtype), preferred_element_type=preferred_element_type)
    # XLA:CPU fuses the producer of ``x`` (a norm, a sum of heads) into the matrix-vector loop it
    # builds around a dequantization, recomputing it for every output row (2.7x slower attention
    # projections); an optimization barrier does not stop it there, a conditional does. The branch
    # taken when x[0] is NaN gives what the product would (NaN everywhere), so the result is exact.
    product = functools.partial(_cpu_product, w.format, w.dtype, preferred_element_type)
    y = jax.eval_shape(product, x, w.fields)
    return jax.lax.cond(jnp.isnan(x.reshape(-1)[0]), lambda x, f: jnp.full(y.shape, jnp.nan, y.dtype), product, x, w.fields)


def _cpu_product(fmt_name: str, dtype: str, preferred_element_type, x, fields):
    """``x @ W`` on XLA:CPU for the fields of a 2-D quantized weight: the fastest form measured
    (tools/bench_quant_dot.py, BENCHMARKS.md "Quantized weights against float (CPU)"): ``x @ W^T``
    over runs of input columns that read the fields affinely (:attr:`QuantFormat.parts`), each
    run's product behind a barrier so their sum does not fuse into (and de-vectorize) the last."""
    fmt = format_of(fmt_name)
    n_in = fmt.in_features(fields)
    parts = fmt.parts(n_in)
    width, y = n_in // parts, None
    for lo in range(0, n_in, width):
        cut = {} if parts == 1 else {"cols": (lo, lo + width)}
        wt = fmt.dequantize(fields, jnp.dtype(dtype), **cut).astype(x.dtype)
        part = jnp.einsum("...i,io->...o", x[..., lo:lo + width], jnp.swapaxes(wt, -1, -2),
                          preferred_element_type=preferred_element_type)
        if parts > 1:
            part = jax.lax.optimization_barrier(part)
        y = part if y is None else y + part
    return y


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
