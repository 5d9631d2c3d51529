"""Hugging Face safetensors checkpoints, read tensor by tensor and strictly: :class:`Checkpoint`,
:class:`Renamed` and :func:`load_named`, shared by every family's and drafter's loader.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` whose ``weight_map`` names a shard per tensor.

Safetensors files are opened with the ``safetensors`` library (``safe_open``, numpy framework:
memory-mapped, tensors read one at a time, BF16 as ``ml_dtypes.bfloat16``); it validates every
header when the file opens, so a truncated or corrupt file fails before any weight is converted.
When it refuses a file, :func:`explain_refusal` names the file and the tensor at fault.

Checks are strict: every problem raises :class:`~dflash_jax.errors.DFlashError` whose message
names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from typing import Any

import jax
import ml_dtypes
import numpy as np
import safetensors

from dflash_jax.errors import DFlashError
from dflash_jax.families.hf_config import read_json
from dflash_jax.formats.quantized import (
    check_tensor,
    check_weights,
    leaf_kind,
    quantized_leaf,
    read_float,
    read_quantization,
    scale_names,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Safetensors dtype codes -> bits per element (the codes the library knows; used to place tensors
# and to explain a refused header).
_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}
# The codes weights may be stored in (read exactly, then cast to the requested dtype).
FLOAT_CODES = ("F16", "BF16", "F32", "F64")
# Stored codes read as bytes (safetensors' numpy reader has no FP8 type), viewed as these dtypes.
_BYTES_READ = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
_TARGET_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}

# Non-parameter buffers some exporters leave in checkpoints.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One header entry: safetensors dtype code, shape, and absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """An open safetensors file (``safetensors.safe_open``, numpy framework); tensors are read one
    at a time.

    Raises (on construction):
      DFlashError: the file is missing, truncated, or its header is corrupt (see
        :func:`read_safetensors_header`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._handle = _open(self.path)
        self.tensors = _tensor_infos(self.path, self._handle)

    def read(self, name: str, raw: bool = False) -> np.ndarray:
        """The tensor ``name`` as a numpy array in its stored float dtype (BF16 as ``ml_dtypes.bfloat16``;
        with ``raw`` any stored dtype, e.g. MXFP4's ``U8`` blocks and scales).

        Raises:
          DFlashError: the tensor is absent or (without ``raw``) stored in a non-float dtype (names
            file and tensor).
        """
        where = f"{self.path}: tensor {name}"
        info = self.tensors.get(name)
        if info is None:
            raise DFlashError(where, "missing", "a tensor of that name in this file")
        if info.dtype not in FLOAT_CODES and not raw:
            raise DFlashError(where, f"unsupported dtype {info.dtype}", "a float dtype: F32, F16, BF16 or F64")
        if info.dtype in _BYTES_READ:  # the library's numpy reader knows no FP8: read the bytes and view them
            data = np.fromfile(self.path, np.uint8, count=info.end - info.start, offset=info.start)
            return data.view(_BYTES_READ[info.dtype]).reshape(info.shape)
        return self._handle.get_tensor(name)


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of a safetensors file, as the ``safetensors`` library validated them.

    Returns:
      ``{name: TensorInfo}`` in file order; byte ranges are absolute (the library checks that the
      tensors tile the data section, so they follow from the sizes).
    Raises:
      DFlashError: missing file, truncated file, corrupt header, unknown dtype code, or a tensor
        whose ``data_offsets`` disagree with its shape or lie past the end of the file (the
        message names the file and, where there is one, the tensor).
    """
    return _tensor_infos(str(path), _open(str(path)))


def _open(path: str):
    """``safe_open(path)``, with the library's refusal turned into a DFlashError naming the file."""
    if os.path.isdir(path):
        raise DFlashError(path, "is a directory", "a safetensors file")
    try:
        return safetensors.safe_open(path, framework="numpy")
    except FileNotFoundError:
        raise DFlashError(path, "file not found", "an existing safetensors file") from None
    except (safetensors.SafetensorError, OSError) as e:
        raise explain_refusal(path, e) from None


def _tensor_infos(path: str, handle) -> dict[str, TensorInfo]:
    data_start = os.path.getsize(path) - sum(_nbytes(handle.get_slice(n)) for n in handle.keys())
    out: dict[str, TensorInfo] = {}
    for name in handle.offset_keys():
        sl = handle.get_slice(name)
        out[name] = TensorInfo(sl.get_dtype(), tuple(sl.get_shape()), data_start, data_start + _nbytes(sl))
        data_start = out[name].end
    return out


def _nbytes(sl) -> int:
    return math.prod(sl.get_shape()) * _BITS.get(sl.get_dtype(), 8) // 8


def explain_refusal(path: str, err: Exception) -> DFlashError:
    """Why the library refused ``path``, as a DFlashError naming the file and, where there is one,
    the tensor at fault (its own message names none): the header is read again to find it."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return DFlashError(path, f"truncated: {size} bytes", "an 8-byte header length and a JSON header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return DFlashError(path, f"corrupt or truncated: header length {n} but the file has {size} bytes", "a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:  # bad UTF-8 or bad JSON
        return DFlashError(path, f"corrupt header ({e})", "a JSON safetensors header")
    for name, entry in header.items() if isinstance(header, dict) else ():
        where, entry = f"{path}: tensor {name}", entry if isinstance(entry, dict) else {}
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if name == "__metadata__" or dtype not in _BITS:
            continue
        try:
            nbytes, (begin, end) = math.prod(shape) * _BITS[dtype] // 8, offs
        except (TypeError, ValueError):
            return DFlashError(where, f"corrupt shape {shape!r} or data_offsets {offs!r}", "{dtype, shape, data_offsets}")
        if end - begin != nbytes:
            return DFlashError(where, f"data_offsets {offs} span {end - begin} bytes for {dtype} {tuple(shape)}", f"{nbytes} bytes")
        if 8 + n + end > size:
            return DFlashError(where, f"truncated file: data ends at byte {8 + n + end} but the file has {size} bytes",
                               "the complete file")
    return DFlashError(path, f"corrupt header ({err})", "a safetensors file")


class Checkpoint:
    """The tensors of a checkpoint folder (one file or sharded), each found in its file.

    Raises (on construction):
      DFlashError: no weights file, a malformed index, an index naming a missing shard or a tensor
        its shard lacks, a tensor stored twice, or any corrupt shard.
    """

    def __init__(self, folder: str | os.PathLike):
        folder = str(folder)
        single, index = os.path.join(folder, SINGLE_FILE), os.path.join(folder, INDEX_FILE)
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        if os.path.exists(single):
            f = SafetensorsFile(single)
            self.files[single] = f
            self.where = {name: f for name in f.tensors}
            return
        if not os.path.exists(index):
            raise DFlashError(folder, f"no {SINGLE_FILE} or {INDEX_FILE}", "a safetensors checkpoint folder")
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise DFlashError(f"{index}: field weight_map", "missing or not a {tensor: shard file} object", "a JSON object")
        for name, shard in weight_map.items():
            path = os.path.join(folder, shard)
            if path not in self.files:
                if os.path.basename(shard) != shard or not os.path.isfile(path):
                    raise DFlashError(f"{index}: tensor {name}", f"shard {shard} not found in {folder}", "an existing shard file")
                self.files[path] = SafetensorsFile(path)
            if name not in self.files[path].tensors:
                raise DFlashError(f"{path}: tensor {name}", f"not in this shard, which {INDEX_FILE} names for it",
                                  "the tensor in that shard")
        for f in self.files.values():
            for name in f.tensors:
                if name in self.where:
                    raise DFlashError(f"{f.path}: tensor {name}", f"also stored in {self.where[name].path}", "one copy")
                self.where[name] = f

    def names(self) -> list[str]:
        return list(self.where)

    def file_of(self, name: str) -> str:
        return self.where[name].path

    def info(self, name: str) -> TensorInfo:
        return self.where[name].tensors[name]

    def read(self, name: str, raw: bool = False) -> np.ndarray:
        """The tensor ``name`` in its stored float dtype (any stored dtype with ``raw``)."""
        return self.where[name].read(name, raw)


class Renamed:
    """A :class:`Checkpoint` seen through virtual names: ``views[name] = (real name, fn, shape)``
    where ``fn(array)`` produces the virtual tensor (a fused tensor's slice, say); the ``hidden``
    real names are not listed; other tensors pass through unchanged. Lets one strict name map
    (:func:`load_named`) serve several stored layouts. A view may read several real tensors
    (``real`` a tuple: ``fn(*arrays)``, e.g. MXFP4 blocks and scales) and name the dtype code its
    result has (a fourth entry, e.g. ``"F32"``)."""

    def __init__(self, ckpt: Checkpoint, views: dict, hidden: set):
        self.ckpt, self.views, self.hidden = ckpt, views, hidden
        self.files = ckpt.files

    def names(self) -> list[str]:
        """The real names not hidden, then the virtual ones."""
        return [n for n in self.ckpt.names() if n not in self.hidden] + list(self.views)

    def _real(self, name: str) -> tuple:
        real = self.views[name][0]
        return real if isinstance(real, tuple) else (real,)

    def file_of(self, name: str) -> str:
        """The file holding ``name`` (a view's first real tensor), for messages."""
        return self.ckpt.file_of(self._real(name)[0] if name in self.views else name)

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``: a view's shape (and dtype code) over its first real tensor's."""
        if name in self.views:
            view = self.views[name]
            i = dataclasses.replace(self.ckpt.info(self._real(name)[0]), shape=tuple(view[2]))
            return dataclasses.replace(i, dtype=view[3]) if len(view) > 3 else i
        return self.ckpt.info(name)

    def read(self, name: str, raw: bool = False) -> np.ndarray:
        """The tensor ``name``: a view's ``fn`` of its real tensors (read raw), else the stored one."""
        if name in self.views:
            return self.views[name][1](*(self.ckpt.read(r, raw=True) for r in self._real(name)))
        return self.ckpt.read(name, raw)


# Per-layer tensor names shared by Llama-style decoders: {suffix: (params leaf, transpose)}.
ATTENTION_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
}
MLP_NAMES = {"mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True), "mlp.down_proj.weight": ("w_down", True)}
QK_NORM_NAMES = {"self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False)}


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype of a parameter dtype name or dtype (``float32``, ``bfloat16`` as
    ``ml_dtypes.bfloat16``, ``float16``). Raises DFlashError naming ``dtype`` for others."""
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = str(dtype)
    if name not in _TARGET_DTYPES:
        raise DFlashError("dtype", f"unsupported value {dtype!r}", f"one of {sorted(_TARGET_DTYPES)}")
    return _TARGET_DTYPES[name]


def load_named(ckpt: Checkpoint, folder: str, names: dict, shapes: dict, target: np.dtype, ignorable, label: str,
               weights: str = "float", methods=("fp8",)) -> dict:
    """Reads a params pytree from ``ckpt`` through a name map, strictly, one tensor at a time.

    Args:
      names: ``{tensor name: (pytree path, layer index or None, transpose)}``; tensors with a
        layer index fill that row of a stacked leaf (a tuple index such as ``(layer, expert)``
        fills that sub-array).
      shapes: the params' leaf shapes (one level of nesting at most).
      target: numpy dtype of the result leaves.
      ignorable: predicate for tensor names that may be present and are skipped.
      label: what is being loaded, for messages (``"llama target"``, ``"DFlash drafter"``).
      weights: ``"float"``, ``"quantized"`` or ``"int8"`` (:mod:`dflash_jax.formats.quantized`):
        whether an FP8 checkpoint's linear weights stay FP8, and whether a float one's are
        quantized to int8.
      methods: the ``quantization_config.quant_method`` values the caller reads
        (:func:`dflash_jax.formats.quantized.read_quantization`; ``folder/config.json``).
    Returns:
      The params pytree of jax arrays; a quantized leaf is a
      :class:`~dflash_jax.nn.quant.QuantizedWeight` of the leaf's shape (fields ``[*lead, out, k]``).
    Raises:
      DFlashError: a refused ``quantization_config`` (config.json's field named), a bad ``weights``,
        missing, unexpected, mis-shaped or non-float tensors, FP8 tensors without their scales
        (names file and tensor).
    """
    check_weights(weights)
    q = read_quantization(folder, methods)
    present = set(ckpt.names())
    missing = [n for n in names if n not in present]
    if missing:
        files = sorted({f.path for f in ckpt.files.values()})
        where = files[0] if len(files) == 1 else f"{os.path.join(folder, INDEX_FILE)}"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DFlashError(f"{where}: tensor {missing[0]}", f"missing{more} for a {label}", "every parameter tensor")
    scales = scale_names(ckpt, names, q)
    for n in ckpt.names():
        if n not in names and n not in scales and not ignorable(n):
            raise DFlashError(f"{ckpt.file_of(n)}: tensor {n}", f"unexpected for a {label} of this config",
                              "only the model's parameter tensors")
    by_leaf, fp8 = _validate(ckpt, names, shapes, q, weights)

    def leaf(path) -> jax.Array:
        full = shapes[path[0]] if len(path) == 1 else shapes[path[0]][path[1]]
        where = lambda n: f"{ckpt.file_of(n)}: tensor {n}"  # noqa: E731
        kind = leaf_kind(by_leaf[path], fp8, weights, where)
        if kind != "float":
            return quantized_leaf(ckpt, tuple(full), by_leaf[path], kind, q, target.name)
        out = np.empty(full, target)
        for n, layer, transpose in by_leaf[path]:
            x = read_float(ckpt, n, q, fp8[n])
            x = x.T if transpose else x
            if layer is None:
                out[...] = x.astype(target)
            else:
                out[layer] = x.astype(target)
        return jax.device_put(out)

    params: dict = {}
    for key, value in shapes.items():
        if isinstance(value, dict):
            params[key] = {name: leaf((key, name)) for name in value}
        else:
            params[key] = leaf((key,))
    return params


def _validate(ckpt, names: dict, shapes: dict, q, weights: str) -> tuple[dict, dict]:
    """Every tensor's shape and dtype checked before anything is converted: ``({leaf path:
    [(name, index, transpose)]}, {name: stored as FP8})``."""
    by_leaf: dict[tuple[str, ...], list[tuple[str, int | None, bool]]] = {}
    fp8: dict[str, bool] = {}
    for n, (path, layer, transpose) in names.items():
        full = shapes[path[0]] if len(path) == 1 else shapes[path[0]][path[1]]
        want = full if layer is None else full[len(layer) if isinstance(layer, tuple) else 1:]
        want_hf = tuple(reversed(want)) if transpose else tuple(want)
        info = ckpt.info(n)
        where = f"{ckpt.file_of(n)}: tensor {n}"
        if info.shape != want_hf:
            raise DFlashError(where, f"shape {info.shape}", f"{want_hf} for this config")
        fp8[n] = info.dtype not in FLOAT_CODES and check_tensor(ckpt, n, transpose, q, weights)
        by_leaf.setdefault(path, []).append((n, layer, transpose))
    return by_leaf, fp8
