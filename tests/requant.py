"""Re-encoding a GGUF file's weights with other block types, for tests: every quantized tensor is
dequantized (gguf-py) and written again with the type a rule picks; F32 tensors and the metadata
are copied. Legacy types are written by ``gguf.quants.quantize``; Q4_K and Q6_K (which gguf-py
cannot write) by the small encoders below: valid blocks with simple (not llama.cpp's optimised)
scales, so the re-encoded model stays close to the original."""

from __future__ import annotations

import gguf
import numpy as np

from tiny_gguf import rewrite_gguf

Q = gguf.GGMLQuantizationType


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """``x [rows, in]`` float32 (``in`` a multiple of 256) -> Q6_K blocks uint8 ``[rows, in / 256 * 210]``:
    w = d * scale[s] * (q - 32), 16 sub-blocks of 16, int8 scales, 6-bit codes."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)  # [n, sub, 16]
    sub = np.abs(b).max(-1) / 31  # [n, sub]
    d = sub.max(-1) / 127  # [n]
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(sub, d16[:, None], out=np.zeros_like(sub), where=d16[:, None] > 0)), -127, 127).astype(np.int8)
    s = d16[:, None] * sc
    q = np.clip(np.round(np.divide(b, s[..., None], out=np.zeros_like(b), where=s[..., None] != 0)), -32, 31)
    L = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # [n, half, 128]
    ql = (L[:, :, :64] & 15) | ((L[:, :, 64:] & 15) << 4)  # [n, 2, 64]
    hi = (L >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, 2, 32]
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d16)], axis=1)
    return blocks.reshape(rows, -1)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """``x [rows, in]`` float32 -> Q4_K blocks uint8 ``[rows, in / 256 * 144]``: w = d * sc[s] * q -
    dmin * m[s], 8 sub-blocks of 32, 6-bit sub-scales and mins, 4-bit codes."""
    rows = x.shape[0]
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0)  # [n, 8]
    scale = (b.max(-1) - lo) / 15
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    div = lambda a, c: np.divide(a, c, out=np.zeros_like(a), where=c != 0)  # noqa: E731
    sc = np.clip(np.round(div(scale, d[:, None] + 0 * scale)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(div(-lo, dmin[:, None] + 0 * lo)), 0, 63).astype(np.uint8)
    S, M = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round(div(b + M[..., None], S[..., None] + 0 * b)), 0, 15).astype(np.uint8).reshape(-1, 4, 64)
    qs = (q[:, :, :32] | (q[:, :, 32:] << 4)).reshape(-1, 128)
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=1)
    return blocks.reshape(rows, -1)


ENCODERS = {Q.Q4_K: encode_q4_k, Q.Q6_K: encode_q6_k}


def encode(x: np.ndarray, qtype) -> np.ndarray:
    """``x`` (numpy order, float32) as ``qtype`` blocks (uint8, gguf's byte shape)."""
    if qtype in ENCODERS:
        return ENCODERS[qtype](x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (-1,))
    return gguf.quants.quantize(np.ascontiguousarray(x, np.float32), qtype)


def reencode(src: str, dst: str, type_of) -> dict:
    """Writes ``dst``: ``src``'s metadata and tensors, each quantized tensor re-encoded as
    ``type_of(name, numpy shape)`` (a ``GGMLQuantizationType``); returns ``{name: type name}``."""

    def convert(t):
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        if t.tensor_type == Q.F32:
            return np.array(t.data, np.float32).reshape(shape), None, "F32"
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
        qtype = type_of(t.name, shape)
        return encode(x, qtype), qtype, qtype.name

    return rewrite_gguf(src, dst, convert)
