"""Parameter leaves of the GGUF loaders kept quantized: the tensors that fill one leaf (one per
layer of a stacked leaf) converted by :func:`dflash_jax.formats.gguf_quant.quantized_tensor` and
stacked into one :class:`~dflash_jax.nn.quant.QuantizedWeight`, tensor by tensor (the host holds the
leaf's quantized bytes, never its float values).

A leaf is kept quantized when every tensor filling it has one quantized GGML type (a stacked leaf
needs one format for all its layers). The MoE families split their layer scans by
:func:`layer_formats` so that the layers of one scan share their formats (llama.cpp's ``Q4_K_M``
gives some layers' ``attn_v`` and ``ffn_down`` ``Q6_K``, the others ``Q4_K``); where a stacked
leaf's layers still differ (a family whose stacks are not split so), that leaf is read as float
and the loader says so in its progress line (:func:`mixed_note`).

Layouts: a matrix weight stored as GGUF ``[out, in]`` rows (the loaders' ``"T"``; stacked experts
``[E, out, in]``: ``"E"`` / ``"swap"``) is already the field layout of a quantized ``[in, out]``
weight, so no data moves; a gathered table (``embed [V, H]``, stored as ``V`` rows of ``H``) keeps
its rows (:func:`dflash_jax.nn.quant.take_rows` gathers them, and it doubles as the tied ``[H, V]``
head).
"""

from __future__ import annotations

import numpy as np

from dflash_jax.errors import DFlashError

FLOAT_TYPES = ("F32", "F16", "BF16")
WEIGHTS = ("quantized", "float")
TABLES = ("embed", "embed_pl")  # leaves gathered by row
MATRIX_CONVERSIONS = ("T", "E", "swap")  # the loaders' names of "stored [.., out, in]"


def check_weights(weights: str) -> str:
    """``weights`` (``"auto"`` is ``"quantized"``: a GGUF's quantized tensors stay quantized).
    Raises DFlashError naming the option for another value."""
    if weights == "auto":
        return "quantized"
    if weights not in WEIGHTS:
        raise DFlashError("weights (--weights)", f"got {weights!r}", "quantized, float or auto")
    return weights


def tensor_format(tensor) -> str:
    """The GGML type name of a ``gguf`` ``ReaderTensor`` (``"float"`` for F32/F16/BF16)."""
    kind = tensor.tensor_type.name
    return "float" if kind in FLOAT_TYPES else kind


def layer_formats(tensors: dict, n_layers: int) -> tuple[str, ...]:
    """One string per decoder layer naming the quantized types of its ``blk.{i}.*`` tensors:
    equal strings, equal storage formats (what a family adds to its layer signatures so that one
    scan stacks layers of one format)."""
    per = [[] for _ in range(n_layers)]
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) < n_layers:
            kind = tensor_format(t)
            if kind != "float":
                per[int(parts[1])].append(f"{'.'.join(parts[2:])}={kind}")
    return tuple(",".join(sorted(p)) for p in per)


def quantized_leaf(path: str, tensors: dict, parts, shape: tuple, dtype, table: bool = False):
    """The leaf of float shape ``shape`` filled by ``parts`` as one quantized weight, or ``None``.

    Args:
      path: the file (named in errors); tensors: its tensor table.
      parts: ``[(tensor name, repetition r or None)]``: one tensor for the whole leaf (``r`` None)
        or one per repetition ``r`` of a stacked ``[reps, ...]`` leaf.
      shape: the float leaf's shape (``[.., in, out]``; a table ``[V, H]``).
      dtype: the dtype the weight computes in.
      table: a gathered table (rows kept as rows) rather than a matrix.
    Returns:
      the :class:`~dflash_jax.nn.quant.QuantizedWeight` (numpy fields, stacked over the
      repetitions), or ``None`` when a part is a float tensor or the parts' types differ (the
      caller reads the leaf as float).
    Raises:
      DFlashError: a tensor whose quantized shape does not fit ``shape`` (file and tensor named),
        or what :func:`~dflash_jax.formats.gguf_quant.quantized_tensor` raises.
    """
    from dflash_jax.formats.gguf_quant import quantized_tensor

    kinds = {tensor_format(tensors[name]) for name, _ in parts}
    if len(kinds) != 1 or "float" in kinds:
        return None
    shape, buf, qw = tuple(shape), None, None
    for name, r in parts:
        qw = quantized_tensor(tensors[name], path, str(np.dtype(dtype)))
        got = qw.shape[:-2] + qw.shape[:-3:-1] if table else qw.shape
        want = shape if r is None else shape[1:]
        if tuple(got) != want:
            raise DFlashError(f"{path}: tensor {name}", f"{tensors[name].tensor_type.name} weight of shape {list(got)}",
                              f"{list(want)} for this config")
        if r is None:
            return qw
        if buf is None:
            buf = {k: np.empty((shape[0],) + a.shape, a.dtype) for k, a in qw.fields.items()}
        for k, a in qw.fields.items():
            buf[k][r] = a
    return qw.replace(fields=buf)


def mixed_note(path: str, leaves) -> str:
    """The progress line of leaves read as float because their layers' types differ."""
    return f"{path}: {', '.join(leaves)} read as float (their layers are stored in different quantized types)"
