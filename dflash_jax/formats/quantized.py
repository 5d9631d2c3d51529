"""Quantized safetensors checkpoints: which ``quantization_config`` is read and which is refused, and
the leaves :func:`dflash_jax.formats.checkpoint.load_named` builds from quantized or float tensors.

**The choice** (``weights``, a family loader's keyword; ``dflash_jax.load_target`` resolves its own
option to one of these):

- ``"float"``: every leaf float in the model's dtype; block-scaled FP8 weights are dequantized at
  load, tensor by tensor (``codes * scale_inv`` of their block, :func:`dflash_jax.nn.quant_fp8.dequantize_np`).
- ``"quantized"``: FP8 weights stay FP8 plus their scales (format ``"fp8_block"``,
  :mod:`dflash_jax.nn.quant_fp8`), one byte a weight; float tensors stay float. On a float
  checkpoint this is ``"float"``.
- ``"int8"``: a float checkpoint's decoder-layer linear weights (``*_proj.weight`` tensors of a
  layer: attention and MLP projections, experts; not norms, routers, embeddings or the LM head)
  quantized to int8 at load per group of 128 inputs, one tensor at a time
  (:mod:`dflash_jax.nn.quant_int8`). Refused on an already quantized checkpoint (requantizing FP8
  would lose precision silently).

**Read**: ``quantization_config.quant_method: "fp8"`` with ``fmt: "e4m3"`` (or absent),
``weight_block_size: [bo, bi]`` and ``activation_scheme: "dynamic"`` (the Qwen3-*-FP8 / DeepSeek-V3
layout; activations are not quantized here, :mod:`dflash_jax.nn.quant_fp8`). A family whose loader
reads another method itself names it (gpt-oss: ``"mxfp4"``).

**Refused** (a :class:`~dflash_jax.errors.DFlashError` naming config.json's field
``quantization_config.quant_method``, the value and what is supported; never loaded as float):
AWQ and GPTQ (4-bit integer groups with zero points, packed into int32 ``qweight`` / ``qzeros``),
compressed-tensors (llm-compressor's packed int / FP8 / FP4 variants), ModelOpt (NVFP4:
``quant_algo: "NVFP4"``, FP4 values with FP8 block scales and a global scale; or its per-tensor
FP8), bitsandbytes (int8 with outliers, NF4), per-tensor or static-activation FP8, and any
method not named here.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.families.hf_config import read_json
from dflash_jax.nn import quant, quant_fp8, quant_int8

WEIGHTS = ("float", "quantized", "int8")
FP8_CODE = "F8_E4M3"  # safetensors' code of float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # "<name>.weight" -> "<name>.weight_scale_inv"
INT8_NAMES = re.compile(r"_proj\.weight$")  # decoder-layer linear weights that weights="int8" quantizes
FIELD = "quantization_config.quant_method"
SUPPORTED = '"fp8" with weight_block_size (block-scaled float8_e4m3fn, as Qwen3-*-FP8 and DeepSeek-V3 ship it)'
_REFUSED = {
    "awq": "AWQ: 4-bit integer groups with zero points",
    "gptq": "GPTQ: 4-bit integer groups with zero points",
    "compressed-tensors": "compressed-tensors: llm-compressor's packed int/FP8/FP4 layouts",
    "modelopt": "NVIDIA ModelOpt: NVFP4 or per-tensor FP8",
    "bitsandbytes": "bitsandbytes: int8 with outliers or NF4",
    "fbgemm_fp8": "per-channel FP8 with dynamic activations",
}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A checkpoint's accepted ``quantization_config``: its ``method``, the FP8 ``block``
    ``(bo, bi)`` (``None`` for other methods) and the config.json it came from."""

    method: str
    block: tuple | None
    source: str


def check_weights(weights: str) -> str:
    """``weights`` itself; raises DFlashError naming it unless it is one of :data:`WEIGHTS`."""
    if weights not in WEIGHTS:
        raise DFlashError("weights", f"got {weights!r}", " / ".join(repr(w) for w in WEIGHTS))
    return weights


def read_quantization(folder: str, methods=("fp8",)) -> Quantization | None:
    """The ``quantization_config`` of ``folder/config.json`` (``None`` without one, or without the file).

    Args:
      methods: the ``quant_method`` values the calling loader reads (``"fp8"``: the block-scaled
        FP8 of this module; a family may add its own, gpt-oss ``"mxfp4"``).
    Raises:
      DFlashError: a method not in ``methods`` (AWQ, GPTQ, compressed-tensors, ModelOpt NVFP4,
        bitsandbytes, unknown ones), or FP8 without ``weight_block_size``, with a format other than
        e4m3 or with a static activation scheme: names the file and the field, the value and what
        is supported.
    """
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    qc = read_json(path).get("quantization_config")
    if qc is None:
        return None
    where = f"{path}: field {FIELD}"
    if not isinstance(qc, dict):
        raise DFlashError(f"{path}: field quantization_config", f"{qc!r}", "an object with quant_method")
    method = qc.get("quant_method")
    supported = SUPPORTED if methods == ("fp8",) else f"{SUPPORTED}, or {', '.join(repr(m) for m in methods if m != 'fp8')}"
    if str(qc.get("quant_algo", "")).upper() == "NVFP4" or str(method).lower() == "nvfp4":
        raise DFlashError(where, f"{method!r} with quant_algo NVFP4 (FP4 values, FP8 block scales) is not supported", supported)
    if method not in methods:
        kind = _REFUSED.get(str(method).lower(), "an unknown method")
        raise DFlashError(where, f"{method!r} ({kind}) is not supported", supported)
    if method != "fp8":
        return Quantization(method, None, path)
    return Quantization("fp8", _fp8_block(qc, path), path)


def _fp8_block(qc: dict, path: str) -> tuple:
    block, fmt, act = qc.get("weight_block_size"), qc.get("fmt", "e4m3"), qc.get("activation_scheme", "dynamic")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise DFlashError(f"{path}: field quantization_config.weight_block_size", f"{block!r}",
                          "[rows, columns] of one scale's block, e.g. [128, 128] (per-tensor FP8 is not supported)")
    if fmt != "e4m3":
        raise DFlashError(f"{path}: field quantization_config.fmt", f"{fmt!r}", '"e4m3" (float8_e4m3fn weights)')
    if act != "dynamic":
        raise DFlashError(f"{path}: field quantization_config.activation_scheme", f"{act!r}",
                          '"dynamic" (weights only are read; a static scheme\'s input scales are not)')
    return tuple(block)


def scale_names(ckpt, names, q: Quantization | None) -> set:
    """The ``weight_scale_inv`` tensors that the FP8 tensors among ``names`` (present in ``ckpt``) need."""
    if q is None or q.method != "fp8":
        return set()
    present = set(ckpt.names())
    return {n + SCALE_SUFFIX for n in names if n in present and ckpt.info(n).dtype == FP8_CODE}


def check_tensor(ckpt, name: str, transpose: bool, q: Quantization | None, weights: str) -> bool:
    """Checks a tensor stored in a non-float dtype (the caller passes float ones by): it must be an
    FP8 linear weight of an FP8 checkpoint, with its scale tensor of the right shape; returns True.

    Raises:
      DFlashError: a non-float dtype other than FP8, FP8 in a checkpoint without the FP8
        ``quantization_config``, FP8 where no linear weight is, a missing or mis-shaped
        ``weight_scale_inv``, or ``weights="int8"`` on an FP8 checkpoint (file and tensor named).
    """
    info, where = ckpt.info(name), f"{ckpt.file_of(name)}: tensor {name}"
    if info.dtype != FP8_CODE or q is None or q.method != "fp8":
        fp8 = " (FP8 weights need config.json's quantization_config with quant_method \"fp8\")" if info.dtype == FP8_CODE else ""
        raise DFlashError(where, f"unsupported dtype {info.dtype}{fp8}", "a float dtype: F32, F16, BF16 or F64")
    if weights == "int8":
        raise DFlashError("weights", f'"int8" on {q.source}, an FP8 checkpoint',
                          '"quantized" (keep its FP8) or "float" (dequantize it); int8 quantizes float checkpoints')
    if not transpose or len(info.shape) != 2:
        raise DFlashError(where, f"FP8 {info.shape} where the model holds no linear weight", "a float tensor")
    scale = name + SCALE_SUFFIX
    if scale not in set(ckpt.names()):
        raise DFlashError(f"{ckpt.file_of(name)}: tensor {scale}", f"missing: the scales of FP8 tensor {name}",
                          f"float [ceil(out / {q.block[0]}), ceil(in / {q.block[1]})] beside every FP8 weight")
    quant_fp8.check_scale_shape(info.shape, ckpt.info(scale).shape, q.block, f"{ckpt.file_of(scale)}: tensor {scale}")
    return True


def leaf_kind(entries, fp8: dict, weights: str, where) -> str:
    """How to build one leaf from its tensors ``entries`` ``[(name, index, transpose)]``:
    ``"fp8"``, ``"int8"`` or ``"float"`` (module docstring); ``fp8[name]`` from :func:`check_tensor`.
    Raises DFlashError naming a tensor when ``weights="quantized"`` meets a leaf of FP8 and float
    tensors mixed (``where(name)`` gives its file and tensor)."""
    kinds = {fp8[n] for n, _, _ in entries}
    if True in kinds and weights == "quantized":
        if False in kinds:
            n = next(n for n, _, _ in entries if not fp8[n])
            raise DFlashError(where(n), "float, where the other tensors of its parameter are FP8",
                              'all FP8 or all float (weights="float" dequantizes them)')
        return "fp8"
    if weights == "int8" and all(i is not None and t and INT8_NAMES.search(n) for n, i, t in entries):
        return "int8"
    return "float"


def read_float(ckpt, name: str, q: Quantization | None, is_fp8: bool) -> np.ndarray:
    """Tensor ``name`` as float: stored float as it is, FP8 dequantized with its block scales."""
    if not is_fp8:
        return ckpt.read(name)
    return quant_fp8.dequantize_np(ckpt.read(name, raw=True), ckpt.read(name + SCALE_SUFFIX), q.block)


def quantized_leaf(ckpt, full: tuple, entries, kind: str, q: Quantization | None, dtype: str) -> quant.QuantizedWeight:
    """One ``[*lead, in, out]`` leaf as a :class:`~dflash_jax.nn.quant.QuantizedWeight`, filled
    tensor by tensor (each ``[out, in]``; an entry's index picks its place in ``lead``): ``kind``
    ``"fp8"`` keeps the checkpoint's FP8 codes and scales, ``"int8"`` quantizes the float tensors."""
    lead, (n_in, n_out) = tuple(full[:-2]), tuple(full[-2:])
    if kind == "fp8":
        fmt, groups, code = quant_fp8.format_name(q.block[1]), -(-n_in // q.block[1]), quant_fp8.CODE_DTYPE
    else:
        fmt, groups, code = quant_int8.NAME, -(-n_in // quant_int8.GROUP), np.dtype(np.int8)
    codes, scale = np.empty(lead + (n_out, n_in), code), np.empty(lead + (n_out, groups), np.float32)
    for name, index, _ in entries:
        if kind == "fp8":
            f = quant_fp8.fields_from_checkpoint(ckpt.read(name, raw=True), ckpt.read(name + SCALE_SUFFIX), q.block)
        else:
            f = quant_int8.quantize(ckpt.read(name))
        at = ... if index is None else index
        codes[at], scale[at] = f["codes"], f["scale"]
    return quant.QuantizedWeight({"codes": jax.device_put(codes), "scale": jax.device_put(scale)}, fmt, dtype)
