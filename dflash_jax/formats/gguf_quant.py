"""GGUF tensors kept quantized: a file's block bytes re-expressed as the fields of a
:class:`~dflash_jax.nn.quant.QuantizedWeight` (numpy, once per tensor at load).

:func:`quantized_tensor` is the one entry point the GGUF loaders call, tensor by tensor (streaming:
it reads the tensor's memory-mapped bytes and returns arrays about their size, never the float
tensor). The field layouts and the jnp dequantizers are in :mod:`dflash_jax.nn.quant_gguf`; the
block layouts (bytes in a block, in order) follow ggml's ``block_q*`` structs (``ggml-common.h``),
as ``gguf-py``'s ``gguf.quants`` reads them:

======  =====  ========================================================================
type    block  bytes of one block, in file order
======  =====  ========================================================================
Q4_0    32     d f16, qs[16]
Q4_1    32     d f16, m f16, qs[16]
Q5_0    32     d f16, qh[4], qs[16]
Q5_1    32     d f16, m f16, qh[4], qs[16]
Q8_0    32     d f16, qs[32] int8
MXFP4   32     e u8 (E8M0), qs[16] (e2m1 nibbles)
Q2_K    256    scales[16] (4-bit scale | 4-bit min << 4), qs[64], d f16, dmin f16
Q3_K    256    hmask[32], qs[64], scales[12] (sixteen 6-bit scales, biased by 32), d f16
Q4_K    256    d f16, dmin f16, scales[12] (eight 6-bit scales and eight 6-bit mins), qs[128]
Q5_K    256    d f16, dmin f16, scales[12] (as Q4_K), qh[32], qs[128]
Q6_K    256    ql[128], qh[64], scales[16] int8, d f16
======  =====  ========================================================================
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.nn import quant_gguf  # noqa: F401  (registers the GGUF formats)
from dflash_jax.nn.quant import QuantizedWeight

FLOAT_TYPES = ("F32", "F16", "BF16")

# type name -> (format name, weights per block, [(field, first byte, bytes, kind)]), kind: "u8"
# (bytes as is), "i8", "f16" (one float16), "k6" (Q4_K/Q5_K's packed 6-bit scales: two fields),
# "k3" (Q3_K's packed 6-bit scales, unbiased to int8), or a sub-byte code field in ggml's order,
# re-packed into bit planes (nn/quant_gguf.py): "n16"/"n32"/"n64" nibbles (byte j of each run of
# that many bytes holds code j low, code j + run high), "c32" 2-bit crumbs (bits 2s of byte j of
# 32: code 32 s + j), "b32" bits (bit b of byte j of 32: code 32 b + j), "ble" Q5_0/Q5_1's high
# bits (a little-endian uint32 per block, bit i for code i).
_LAYOUTS = {
    "Q4_0": ("q4_0", 32, [("scale", 0, 2, "f16"), ("codes", 2, 16, "n16")]),
    "Q4_1": ("q4_1", 32, [("scale", 0, 2, "f16"), ("offset", 2, 2, "f16"), ("codes", 4, 16, "n16")]),
    "Q5_0": ("q5_0", 32, [("scale", 0, 2, "f16"), ("high", 2, 4, "ble"), ("codes", 6, 16, "n16")]),
    "Q5_1": ("q5_1", 32, [("scale", 0, 2, "f16"), ("offset", 2, 2, "f16"), ("high", 4, 4, "ble"), ("codes", 8, 16, "n16")]),
    "Q8_0": ("q8_0", 32, [("scale", 0, 2, "f16"), ("codes", 2, 32, "i8")]),
    "MXFP4": ("mxfp4", 32, [("exponent", 0, 1, "u8"), ("codes", 1, 16, "n16")]),
    "Q2_K": ("q2_k", 256, [("sub", 0, 16, "u8"), ("codes", 16, 64, "c32"), ("scale", 80, 2, "f16"), ("offset", 82, 2, "f16")]),
    "Q3_K": ("q3_k", 256, [("high", 0, 32, "b32"), ("codes", 32, 64, "c32"), ("sub", 96, 12, "k3"), ("scale", 108, 2, "f16")]),
    "Q4_K": ("q4_k", 256, [("scale", 0, 2, "f16"), ("offset", 2, 2, "f16"), ("sub", 4, 12, "k6"), ("codes", 16, 128, "n32")]),
    "Q5_K": ("q5_k", 256, [("scale", 0, 2, "f16"), ("offset", 2, 2, "f16"), ("sub", 4, 12, "k6"), ("high", 16, 32, "b32"),
                           ("codes", 48, 128, "n32")]),
    "Q6_K": ("q6_k", 256, [("codes", 0, 128, "n64"), ("high", 128, 64, "c32"), ("sub", 192, 16, "i8"), ("scale", 208, 2, "f16")]),
}
_SUB_BYTE = {"n16": 4, "n32": 4, "n64": 4, "c32": 2, "b32": 1, "ble": 1}  # kind -> bits per code
SUPPORTED = tuple(_LAYOUTS)


def block_bytes(type_name: str) -> int:
    """Bytes of one block of ``type_name`` (the end of its last field)."""
    return max(start + size for _, start, size, _ in _LAYOUTS[type_name][2])


def quantized_tensor(tensor, path: str, dtype="float32") -> QuantizedWeight | None:
    """One GGUF tensor as a :class:`QuantizedWeight` of numpy fields, or ``None`` for a float one.

    Args:
      tensor: a ``gguf.ReaderTensor`` (an entry of ``GGUFReader.tensors``); its ggml shape
        ``[in, out, *lead reversed]`` gives fields ``[*lead, out, k]`` (numpy order, rows are
        output features, blocks run along the input dimension).
      path: the file, for error messages.
      dtype: the float dtype the weight computes in (``QuantizedWeight.dtype``).
    Returns:
      ``None`` for F32, F16 and BF16 tensors (they stay float: read them with
      :func:`dflash_jax.formats.gguf_file.dequantize_tensor`); otherwise the weight, its fields
      numpy arrays (host memory about the tensor's bytes in the file; the caller moves them to the
      device).
    Raises:
      DFlashError: a type outside :data:`SUPPORTED`, an input dimension that is not a whole number
        of blocks, or data whose size does not fit the declared shape (names file, tensor, type).
    """
    kind = tensor.tensor_type.name
    if kind in FLOAT_TYPES:
        return None
    where = f"{path}: tensor {tensor.name}"
    if kind not in _LAYOUTS:
        raise DFlashError(where, f"quantization type {kind} is not supported", " / ".join(FLOAT_TYPES + SUPPORTED))
    fmt, block, layout = _LAYOUTS[kind]
    shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))  # numpy order [*lead, out, in]
    nbytes = block_bytes(kind)
    if len(shape) < 2 or shape[-1] % block:
        raise DFlashError(where, f"{kind} tensor of shape {list(shape)}", f"at least 2 dims, the last a multiple of {block}")
    rows, n_blocks = shape[:-1], shape[-1] // block
    data = np.asarray(tensor.data)
    want = math.prod(rows) * n_blocks * nbytes
    if data.dtype != np.uint8 or data.size != want:
        raise DFlashError(where, f"{kind} data of {data.size * data.dtype.itemsize} bytes for shape {list(shape)} (truncated file?)",
                          f"{want} bytes")
    blocks = data.reshape(rows + (n_blocks, nbytes))
    fields: dict = {}
    for name, start, size, how in layout:
        raw = blocks[..., start:start + size]
        if how == "f16":
            fields[name] = np.ascontiguousarray(raw).view(np.float16).reshape(rows + (n_blocks,))
        elif how in ("u8", "i8"):
            fields[name] = np.ascontiguousarray(raw).view(np.int8 if how == "i8" else np.uint8).reshape(rows + (-1,))
        elif how in _SUB_BYTE:
            fields[name] = _planes(raw, how, shape[-1])
        elif how == "k6":
            sub, submin = _unpack_k6(raw)
            fields["sub"], fields["submin"] = sub.reshape(rows + (-1,)), submin.reshape(rows + (-1,))
        else:
            fields[name] = _unpack_k3(raw).reshape(rows + (-1,))
    return QuantizedWeight(fields=fields, format=fmt, dtype=str(np.dtype(dtype)))


def _ggml_codes(raw: np.ndarray, how: str) -> np.ndarray:
    """A sub-byte code field's bytes ``[..., n_blocks, bytes]`` in ggml's order (``_LAYOUTS``'s
    kinds) -> one code per byte ``[..., n_blocks, weights]`` in column order."""
    if how[0] == "n":
        c = raw.reshape(raw.shape[:-1] + (-1, int(how[1:])))
        q = np.concatenate([c & 0x0F, c >> 4], axis=-1)
    elif how == "c32":
        q = raw.reshape(raw.shape[:-1] + (-1, 1, 32)) >> np.array([0, 2, 4, 6], np.uint8)[:, None] & 0x03
    elif how == "b32":
        q = raw.reshape(raw.shape[:-1] + (1, 32)) >> np.arange(8, dtype=np.uint8)[:, None] & 0x01
    else:  # "ble"
        q = raw[..., None] >> np.arange(8, dtype=np.uint8) & 0x01
    return q.reshape(raw.shape[:-1] + (-1,))


def _planes(raw: np.ndarray, how: str, n_in: int, chunk: int = 4096) -> np.ndarray:
    """A sub-byte code field ``raw [*rows, n_blocks, bytes]`` (ggml's order) -> bit planes
    ``uint8 [*rows, n_in * bits / 8]`` (nn/quant_gguf.py): bits ``b i ..`` of byte ``p`` hold the
    code of column ``i * n_in / n + p``, ``n = 8 / bits``. Converts ``chunk`` rows at a time, on
    the host's cores (numpy releases the GIL), holding one code per byte for those rows only."""
    bits = _SUB_BYTE[how]
    n = 8 // bits
    rows = raw.shape[:-2]
    flat = raw.reshape((-1,) + raw.shape[-2:])
    out = np.empty((flat.shape[0], n_in // n), np.uint8)

    def convert(r):
        if how[0] == "n" and n_in % (4 * int(how[1:])) == 0:
            out[r:r + chunk] = _nibble_planes(flat[r:r + chunk], int(how[1:]))
        else:
            q = _ggml_codes(flat[r:r + chunk], how).reshape(-1, n, n_in // n)
            out[r:r + chunk] = np.bitwise_or.reduce(q << (bits * np.arange(n, dtype=np.uint8))[:, None], axis=1)

    starts = range(0, flat.shape[0], chunk)
    if len(starts) > 1:
        with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:
            list(pool.map(convert, starts))
    else:
        convert(0)
    return out.reshape(rows + (-1,))


def _nibble_planes(raw: np.ndarray, run: int) -> np.ndarray:
    """ggml's nibbles (each run of ``run`` bytes: codes ``j`` low, ``j + run`` high) of rows
    ``[r, n_blocks, bytes]`` whose runs split evenly between the two halves of a row -> planes
    ``[r, n_in / 2]``, byte by byte, without one code per byte (the common Q4 case, ~5x faster)."""
    runs = raw.reshape(raw.shape[0], -1, run)
    half = runs.shape[1] // 2
    lo, hi = runs[:, :half], runs[:, half:]
    out = np.concatenate([lo & 0x0F, lo >> 4], axis=-1)
    out |= np.concatenate([hi << 4, hi & 0xF0], axis=-1)
    return out.reshape(raw.shape[0], -1)


def _unpack_k6(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K scales: 12 bytes -> 8 sub-block scales and 8 mins (uint8, 6 bits each).

    Bytes 0-3 hold scales 0-3 in their low 6 bits (top 2 bits: bits 4-5 of scale 4-7), bytes 4-7
    mins 0-3 likewise (top bits: of mins 4-7), bytes 8-11 the low nibbles of scales 4-7 (low) and
    mins 4-7 (high) (ggml ``get_scale_min_k4``).
    """
    d, m, md = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sub = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 6) << 4)], axis=-1)
    submin = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return sub.astype(np.uint8), submin.astype(np.uint8)


def _unpack_k3(raw: np.ndarray) -> np.ndarray:
    """Q3_K scales: 12 bytes -> 16 sub-block scales as int8 (the 6-bit value minus 32).

    Scale ``i``'s low 4 bits are nibble ``i // 8`` of byte ``i % 8``; its high 2 bits are bits
    ``2 (i // 4)`` of byte ``8 + i % 4`` (ggml ``dequantize_row_q3_K``'s ``kmask`` unpacking).
    """
    i = np.arange(16)
    low = (raw[..., i % 8] >> (4 * (i // 8)).astype(np.uint8)) & 0x0F
    high = (raw[..., 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & 0x03
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
