"""The GGUF (llama.cpp) block formats as :class:`~dflash_jax.nn.quant.QuantFormat` s: the jnp
dequantizers that run inside jit, where XLA fuses them into the product.

**Fields.** Each format keeps the file's own bits in fields ``[*lead, out, k]`` (the
:class:`~dflash_jax.nn.quant.QuantizedWeight` convention; a GGUF row is one output feature): the
integer codes (``codes``; ``high``: the high bits of 5- and 6-bit codes, and Q3_K's sign bits), the
block scale and offset as float16 (``scale``, ``offset``; the K-quants' super-block ``d`` and
``dmin``) and the K-quants' small integer sub-block scales and minimums (``sub``, ``submin``;
Q3_K's and Q4_K/Q5_K's 6-bit fields unpacked to one byte each). So a weight takes at most 1.04x
its bytes in the file (Q3_K, Q4_K, Q5_K; the others exactly their size).

**Planes.** A field of ``b``-bit codes (``b`` in 1, 2, 4) packs ``n = 8 / b`` of them per byte in
*planes*: bits ``b i .. b i + b - 1`` of byte ``p`` of a row hold the code of input column
``i * in / n + p``. So plane ``i`` is one shift and one mask of the whole byte row and covers a
contiguous run of columns: any run of columns inside one plane is an affine read, which XLA:CPU
fuses into a vectorized matrix-vector loop (:func:`~dflash_jax.nn.quant.dot` splits a one-row
product along the planes; ggml's own order interleaves columns within a byte, and unpacking it in a
fused loop ran 4-5x slower, BENCHMARKS.md "Quantized weights against float (CPU)"). The load side,
:mod:`dflash_jax.formats.gguf_quant`, re-packs ggml's order into planes (numpy, once per tensor).

The value of each code follows the block layouts of ggml (``ggml-common.h``, ``ggml-quants.c``
``dequantize_row_*``) as ``gguf-py``'s ``gguf.quants`` writes them in numpy; a weight dequantized
here equals ``gguf.quants.dequantize`` of its blocks within float32 rounding (tests/test_quant_gguf.py).

Block sizes (weights per block along the input dimension): 32 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
MXFP4; 256 (a super-block of 16 or 8 sub-blocks) for Q2_K..Q6_K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.nn.quant import QuantFormat, register

QK = 32  # weights per block of the legacy formats and MXFP4
QK_K = 256  # weights per super-block of the K-quants
RUN = 512  # the most input columns of one part of an XLA:CPU product (tools/bench_quant_dot.py: 384-column
# parts of a 1536-column Q4_1 matrix ran 1.3x faster than 768-column ones)


class Columns:
    """Input columns ``[lo, hi)`` of one weight's fields, seen in groups of ``g`` columns (``lo``
    and ``hi`` multiples of ``g``, the format's smallest group): codes ``[..., out, n, g]`` and
    per-group values ``[..., out, n, 1]`` (``n = (hi - lo) / g``), so XLA's loop over a group reads
    contiguous codes and one scale."""

    def __init__(self, fields: dict, n_in: int, g: int, cols=None):
        self.f, self.n_in, self.g = fields, n_in, g
        self.lo, self.hi = cols if cols is not None else (0, n_in)

    def codes(self, name: str, bits: int) -> jnp.ndarray:
        """Field ``name``'s ``bits``-bit codes (planes, module docstring) of the columns, uint8
        (int8 for the one-code-per-byte Q8_0)."""
        c = self.f[name]
        if bits == 8:
            q = c[..., self.lo:self.hi]
        else:
            n, mask = 8 // bits, (1 << bits) - 1
            width = self.n_in // n
            parts = []
            for i in range(self.lo // width, (self.hi - 1) // width + 1):
                a, b = max(self.lo, i * width) - i * width, min(self.hi, (i + 1) * width) - i * width
                parts.append((c[..., a:b] >> (bits * i)) & mask if i else c[..., a:b] & mask)
            q = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        return q.reshape(q.shape[:-1] + (-1, self.g))

    def group(self, name: str, size: int, a=None) -> jnp.ndarray:
        """Field ``name`` (or the array ``a``), one value per ``size`` columns, as float32 ``[..., out, n, 1]``."""
        a = self.f[name] if a is None else a
        r = size // self.g
        a = a[..., self.lo // size:(self.hi - 1) // size + 1]
        if r > 1:
            a = jnp.repeat(a, r, axis=-1)[..., (self.lo // self.g) % r:][..., :(self.hi - self.lo) // self.g]
        return _f32(a)[..., None]


def _f32(a):
    return a.astype(jnp.float32)


def _fmt(name, bits, per_byte, planes, g, deq):
    """Registers format ``name``: ``deq(Columns) -> float32 [..., out, n, g]``; ``bits`` of the
    ``codes`` field (its bytes times ``per_byte`` is the input dimension); ``planes``: the most
    planes of any field; ``g``: the smallest group of columns sharing a scale. A product splits
    into runs of whole groups, each inside one plane, of at most ``RUN`` columns where it can."""

    def n_in(f):
        return f["codes"].shape[-1] * per_byte

    def dequantize(f, dtype, cols=None):
        w = deq(Columns(f, n_in(f), g, cols))
        return w.reshape(w.shape[:-2] + (-1,)).astype(dtype)

    def parts(n):
        ok = [p for p in range(planes, n // g + 1, planes) if n % (p * g) == 0]
        return next((p for p in ok if n // p <= RUN), ok[-1] if ok else 1)

    return register(QuantFormat(name, n_in, dequantize, parts=parts))


# -- legacy formats: blocks of 32 ---------------------------------------------------------------------------------

def _q5(c):  # 5-bit codes: low nibbles in codes, bit 4 in high
    return c.codes("codes", 4) | (c.codes("high", 1) << 4)


_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _e8m0_half(e):
    """An E8M0 exponent byte as float32 ``2^(e - 128)`` (half the OCP MX scale ``2^(e - 127)``,
    as ggml's ``ggml_e8m0_to_fp32_half``, since the e2m1 table above is doubled), built from bits."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _mxfp4(c):  # codes: e2m1 nibbles; exponent u8 per 32
    q = jnp.take(jnp.asarray(_E2M1_DOUBLED), c.codes("codes", 4).astype(jnp.int32))
    return q * c.group("exponent", QK, _e8m0_half(c.f["exponent"]))


_fmt("q8_0", 8, 1, 1, QK, lambda c: _f32(c.codes("codes", 8)) * c.group("scale", QK))
_fmt("q4_0", 4, 2, 2, QK, lambda c: _f32(c.codes("codes", 4).astype(jnp.int8) - 8) * c.group("scale", QK))  # w = d (q - 8)
_fmt("q4_1", 4, 2, 2, QK, lambda c: _f32(c.codes("codes", 4)) * c.group("scale", QK) + c.group("offset", QK))  # w = d q + m
_fmt("q5_0", 4, 2, 8, QK, lambda c: _f32(_q5(c).astype(jnp.int8) - 16) * c.group("scale", QK))  # w = d (q - 16)
_fmt("q5_1", 4, 2, 8, QK, lambda c: _f32(_q5(c)) * c.group("scale", QK) + c.group("offset", QK))  # w = d q + m
_fmt("mxfp4", 4, 2, 2, QK, _mxfp4)


# -- K-quants: super-blocks of 256 --------------------------------------------------------------------------------

def _sub_scaled(c, q, sub, n_sub, submin=None):
    """Codes ``q`` times the super-block scale ``d`` times the integer sub-block scale ``sub``
    (one per ``256 / n_sub`` columns), minus ``dmin * submin`` when the format has minimums."""
    g = QK_K // n_sub
    w = _f32(q) * (c.group("scale", QK_K) * c.group("sub", g, sub))
    if submin is not None:
        w = w - c.group("offset", QK_K) * c.group("submin", g, submin)
    return w


def _q2_k(c):  # codes 2-bit; sub u8 per 16: low nibble scale, high nibble min; scale, offset f16
    return _sub_scaled(c, c.codes("codes", 2), c.f["sub"] & 0x0F, 16, c.f["sub"] >> 4)


def _q3_k(c):  # codes 2-bit; high 1-bit (set: no -4); sub i8 per 16; scale f16
    q = c.codes("codes", 2).astype(jnp.int8) - ((1 - c.codes("high", 1)).astype(jnp.int8) << 2)
    return _sub_scaled(c, q, c.f["sub"], 16)


def _q4_k(c):  # codes 4-bit; sub, submin u8 per 32 (6-bit); scale, offset f16
    return _sub_scaled(c, c.codes("codes", 4), c.f["sub"], 8, c.f["submin"])


def _q5_k(c):  # + high 1-bit: bit 4 of each code
    return _sub_scaled(c, c.codes("codes", 4) | (c.codes("high", 1) << 4), c.f["sub"], 8, c.f["submin"])


def _q6_k(c):  # codes 4-bit low, high 2-bit; sub i8 per 16; scale f16
    q = (c.codes("codes", 4) | (c.codes("high", 2) << 4)).astype(jnp.int8) - 32
    return _sub_scaled(c, q, c.f["sub"], 16)


_fmt("q2_k", 2, 4, 4, 16, _q2_k)
_fmt("q3_k", 2, 4, 8, 16, _q3_k)
_fmt("q4_k", 4, 2, 2, 32, _q4_k)
_fmt("q5_k", 4, 2, 8, 32, _q5_k)
_fmt("q6_k", 4, 2, 4, 16, _q6_k)
