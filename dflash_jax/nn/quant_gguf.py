"""The GGUF (llama.cpp) block formats as :class:`~dflash_jax.nn.quant.QuantFormat` s: the jnp
dequantizers that run inside jit, where XLA fuses them into the product.

Each format keeps the file's own bits, re-arranged only into fields ``[*lead, out, k]`` (the
:class:`~dflash_jax.nn.quant.QuantizedWeight` convention; a GGUF row is one output feature with its
blocks along the input dimension): the packed code bytes of every block concatenated along the row
(``codes``: the low bits, ``high``: the high bits of 5- and 6-bit codes, both in the file's order),
the block scale and offset as float16 (``scale``, ``offset``; the K-quants' super-block ``d`` and
``dmin``) and the K-quants' small integer sub-block scales and minimums (``sub``, ``submin``;
Q3_K's and Q4_K/Q5_K's 6-bit fields unpacked to one byte each). So a weight takes at most 1.04x
its bytes in the file (Q3_K, Q4_K, Q5_K; the others exactly their size). The load side (the
numpy converter from a file's block bytes) is :mod:`dflash_jax.formats.gguf_quant`.

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


def _f32(a):
    return a.astype(jnp.float32)


def _split_last(a, *shape):
    """``[..., k]`` -> ``[..., *shape]`` (one ``-1`` allowed)."""
    return a.reshape(a.shape[:-1] + shape)


def _nibbles(codes, half):
    """Packed bytes ``[..., n * half]`` -> 4-bit codes ``[..., n, 2 * half]``: byte ``j`` of a
    group holds code ``j`` (low nibble) and code ``j + half`` (high nibble), ggml's order."""
    c = _split_last(codes, -1, half)
    return jnp.concatenate([c & 0x0F, c >> 4], axis=-1)


def _crumbs(codes, lanes):
    """Packed bytes ``[..., n * lanes]`` -> 2-bit codes ``[..., n, 4, lanes]``: bits ``2s`` of
    byte ``j`` hold code ``s * lanes + j`` (Q2_K, Q3_K, Q6_K's high bits)."""
    c = _split_last(codes, -1, 1, lanes)
    return (c >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]) & 0x03


def _bits(high, lanes):
    """Packed bytes ``[..., n * lanes]`` -> 1-bit codes ``[..., n, 8, lanes]``: bit ``b`` of byte
    ``j`` holds code ``b * lanes + j`` (Q3_K's and Q5_K's high bits)."""
    h = _split_last(high, -1, 1, lanes)
    return (h >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 0x01


def _bits_le(high):
    """Q5_0/Q5_1's high bits: 4 bytes per block, a little-endian uint32 whose bit ``i`` belongs to
    code ``i`` -> ``[..., n, 32]``."""
    h = _split_last(high, -1, 4)
    b = (h[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 0x01  # [..., n, 4 bytes, 8 bits]
    return b.reshape(b.shape[:-2] + (32,))


def _scaled(q, scale, offset=None):
    """Codes ``[..., out, n, g]`` times a per-group ``scale [..., out, n]`` (plus ``offset``),
    flattened to ``[..., out, n * g]``."""
    w = _f32(q) * _f32(scale)[..., None]
    if offset is not None:
        w = w + _f32(offset)[..., None]
    return w.reshape(w.shape[:-2] + (-1,))


def _in_from(field, per_byte):
    return lambda f: f[field].shape[-1] * per_byte


def _fmt(name, in_features, deq):
    return register(QuantFormat(name, in_features, lambda f, dtype: deq(f).astype(dtype)))


# -- legacy formats: blocks of 32 ---------------------------------------------------------------------------------


def _q8_0(f):  # codes int8 [.., out, in], scale f16 [.., out, in/32]
    return _scaled(_split_last(f["codes"], -1, QK), f["scale"])


def _q4_0(f):  # codes u8 [.., out, in/2], scale f16: w = d (q - 8)
    return _scaled(_nibbles(f["codes"], QK // 2).astype(jnp.int8) - 8, f["scale"])


def _q4_1(f):  # + offset f16: w = d q + m
    return _scaled(_nibbles(f["codes"], QK // 2), f["scale"], f["offset"])


def _q5(f):  # 5-bit codes: low nibbles in codes, bit 4 in high u8 [.., out, in/8]
    return _nibbles(f["codes"], QK // 2) | (_bits_le(f["high"]) << 4)


def _q5_0(f):  # w = d (q - 16)
    return _scaled(_q5(f).astype(jnp.int8) - 16, f["scale"])


def _q5_1(f):  # w = d q + m
    return _scaled(_q5(f), f["scale"], f["offset"])


_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _e8m0_half(e):
    """An E8M0 exponent byte as float32 ``2^(e - 128)`` (half the OCP MX scale ``2^(e - 127)``,
    as ggml's ``ggml_e8m0_to_fp32_half``, since the e2m1 table above is doubled), built from bits."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _mxfp4(f):  # codes u8 [.., out, in/2] (e2m1 nibbles), exponent u8 [.., out, in/32]
    q = jnp.take(jnp.asarray(_E2M1_DOUBLED), _nibbles(f["codes"], QK // 2).astype(jnp.int32))
    w = q * _e8m0_half(f["exponent"])[..., None]
    return w.reshape(w.shape[:-2] + (-1,))


_fmt("q8_0", _in_from("codes", 1), _q8_0)
_fmt("q4_0", _in_from("codes", 2), _q4_0)
_fmt("q4_1", _in_from("codes", 2), _q4_1)
_fmt("q5_0", _in_from("codes", 2), _q5_0)
_fmt("q5_1", _in_from("codes", 2), _q5_1)
_fmt("mxfp4", _in_from("codes", 2), _mxfp4)


# -- K-quants: super-blocks of 256 --------------------------------------------------------------------------------


def _sub_scaled(q, d, sub, dmin=None, submin=None):
    """Codes ``[..., out, S, n_sub, g]`` over super-block scale ``d [..., out, S]`` times integer
    sub-scales ``sub [..., out, S * n_sub]`` (minus ``dmin * submin``) -> ``[..., out, in]``."""
    n_sub = q.shape[-2]
    ds = _f32(d)[..., None] * _f32(_split_last(sub, -1, n_sub))
    w = _f32(q) * ds[..., None]
    if dmin is not None:
        w = w - (_f32(dmin)[..., None] * _f32(_split_last(submin, -1, n_sub)))[..., None]
    return w.reshape(w.shape[:-3] + (-1,))


def _q2_k(f):  # codes u8 [.., in/4] 2-bit; sub u8 [.., in/16]: low nibble scale, high nibble min; scale, offset f16
    q = _crumbs(f["codes"], 32)  # [.., out, S*2, 4, 32]: code (half, s, j)
    q = q.reshape(q.shape[:-3] + (-1, 16, 16))  # [.., out, S, 16 sub-blocks, 16]
    return _sub_scaled(q, f["scale"], f["sub"] & 0x0F, f["offset"], f["sub"] >> 4)


def _q3_k(f):  # codes u8 [.., in/4] low 2 bits; high u8 [.., in/8] (bit set: no -4); sub i8 [.., in/16]; scale f16
    lo = _crumbs(f["codes"], 32)
    lo = lo.reshape(lo.shape[:-3] + (-1, 256))
    hi = _bits(f["high"], 32)
    hi = hi.reshape(hi.shape[:-3] + (-1, 256))
    q = lo.astype(jnp.int8) - ((1 - hi).astype(jnp.int8) << 2)
    return _sub_scaled(_split_last(q, 16, 16), f["scale"], f["sub"])


def _q4_k_codes(codes):
    """Q4_K/Q5_K low nibbles: 32-byte chunks, the low nibbles code ``j`` and the high nibbles code
    ``j + 32`` of a 64-code pair of sub-blocks -> ``[.., out, S, 8, 32]``."""
    q = _nibbles(codes, 32)  # [.., out, S*4, 64]
    return q.reshape(q.shape[:-2] + (-1, 8, 32))


def _q4_k(f):  # codes u8 [.., in/2]; sub, submin u8 [.., in/32] (6-bit); scale, offset f16
    return _sub_scaled(_q4_k_codes(f["codes"]), f["scale"], f["sub"], f["offset"], f["submin"])


def _q5_k(f):  # + high u8 [.., in/8]: bit b of byte j is bit 4 of code 32 b + j
    hi = _bits(f["high"], 32)  # [.., out, S, 8, 32]
    q = _q4_k_codes(f["codes"]) | (hi << 4)
    return _sub_scaled(q, f["scale"], f["sub"], f["offset"], f["submin"])


def _q6_k(f):  # codes u8 [.., in/2] low nibbles; high u8 [.., in/4] 2 bits; sub i8 [.., in/16]; scale f16
    lo = _nibbles(f["codes"], 64)  # [.., out, S*2, 128]: code (h, nib, j64)
    lo = lo.reshape(lo.shape[:-2] + (-1, 256))
    hi = _crumbs(f["high"], 32)  # [.., out, S*2, 4, 32]: code (h, s, j32)
    hi = hi.reshape(hi.shape[:-3] + (-1, 256))
    q = (lo | (hi << 4)).astype(jnp.int8) - 32
    return _sub_scaled(_split_last(q, 16, 16), f["scale"], f["sub"])


_fmt("q2_k", _in_from("codes", 4), _q2_k)
_fmt("q3_k", _in_from("codes", 4), _q3_k)
_fmt("q4_k", _in_from("codes", 2), _q4_k)
_fmt("q5_k", _in_from("codes", 2), _q5_k)
_fmt("q6_k", _in_from("codes", 2), _q6_k)
