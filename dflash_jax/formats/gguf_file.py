"""Reading the GGUF container (llama.cpp format), shared by every family's GGUF loader.

Opening and memory-mapping a file (``gguf.GGUFReader``), decoding metadata, the tensor table, the
token embedding's vocabulary check, and dequantizing one tensor to float32 with
``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and the other
types ``gguf`` can dequantize). GGUF stores dims in ggml order (``ne[0]`` innermost), so
``tensor.shape`` is the numpy shape reversed.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from typing import Any, Iterator
import numpy as np
from dflash_jax import progress
from dflash_jax.errors import DFlashError


def architecture(path: str | os.PathLike) -> str | None:
    """``general.architecture`` of a GGUF file (``None`` when absent).

    Raises:
      DFlashError: the file is missing, truncated or not a GGUF file.
    """
    return metadata(open_gguf(path), "general.architecture")


def open_gguf(path: str | os.PathLike):
    """Opens (memory-maps) a GGUF file with ``gguf.GGUFReader``.

    Inside :func:`shared_readers`, opening the same file again returns the reader made first.

    Returns:
      the ``gguf.GGUFReader`` (read-only mode).
    Raises:
      DFlashError: the file is missing, truncated or not a GGUF file (the message names it).
    """
    import gguf

    path = str(path)
    if not os.path.isfile(path):
        raise DFlashError(path, "file not found", "an existing .gguf file")
    shared = _SHARED[0]
    if shared is not None and path in shared:
        return shared[path]
    name = os.path.basename(path)
    slow = os.path.getsize(path) >= _REPORT_BYTES  # seconds for a real model's metadata: say so on stderr
    try:
        with progress.step(f"reading the metadata of {name}", f"read the metadata of {name}", routine=not slow):
            reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, struct/IndexError, OSError on bad files
        raise DFlashError(path, f"truncated or corrupt GGUF file ({type(e).__name__}: {e})", "a complete GGUF v2/v3 file") from None
    if shared is not None:
        shared[path] = reader
    return reader


_SHARED: list[dict | None] = [None]
_REPORT_BYTES = 16 << 20  # files from this size on announce their metadata read (small test files do not)


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """Within the block, :func:`open_gguf` parses each file once: the registry (architecture),
    the weight loader and the tokenizer of one load share the reader (parsing the metadata of a
    50k-token vocabulary takes seconds). Nests; the readers are dropped when the outer block ends.
    """
    outer = _SHARED[0]
    if outer is None:
        _SHARED[0] = {}
    try:
        yield
    finally:
        if outer is None:
            _SHARED[0] = None


TOKEN_LISTS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


class _DroppedList:
    """Stands for a list field :func:`drop_token_lists` dropped: its length only (``len(data)``)."""

    def __init__(self, name: str, n: int):
        self.name, self.data = name, range(n)

    def contents(self, *_):
        raise DFlashError(f"metadata {self.name}", "dropped from this reader after the tokenizer was built", "a fresh reader")


def drop_token_lists(reader) -> None:
    """Frees a reader's parsed token lists (:data:`TOKEN_LISTS`; ``gguf.GGUFReader`` holds a numpy
    view per string: about 160 MB of host memory for a 49k-token vocabulary) once the tokenizer is
    built, keeping their lengths (the embedding's vocabulary check reads them). A quantized load
    calls it before reading the weights, so the two do not add up in the loading peak."""
    for key in TOKEN_LISTS:
        field = reader.fields.get(key)
        if field is not None and not isinstance(field, _DroppedList):
            reader.fields[key] = _DroppedList(key, len(field.data))
    gc.collect()  # the views form cycles with their memory map: free them now, before the weights


def release_pages(reader, tensor) -> None:
    """Drops the pages of ``tensor``'s bytes from the process's resident memory (``madvise
    MADV_DONTNEED`` on the reader's read-only file mapping; a later read maps them from the file
    again, so views stay valid), so a load that converts tensor by tensor does not accumulate the
    whole file in its resident set. A no-op where the mapping or ``madvise`` is unavailable."""
    import mmap

    m = getattr(getattr(reader, "data", None), "_mmap", None)
    if m is None or not hasattr(m, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = int(tensor.data_offset) // page * page
    end = int(tensor.data_offset) + int(tensor.n_bytes)
    try:
        m.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):
        pass


def reader_name(reader) -> str:
    """The file name behind a ``gguf.GGUFReader`` (for error messages)."""
    return str(getattr(getattr(reader, "data", None), "filename", None) or "gguf")


def metadata(reader, key: str, default: Any = None) -> Any:
    """The decoded value of GGUF metadata ``key`` (int/float/bool/str or a list), ``default`` if absent.

    Raises:
      DFlashError: the field exists but cannot be decoded (names the file and key).
    """
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:
        raise DFlashError(f"{reader_name(reader)}: metadata {key}", f"unreadable ({type(e).__name__}: {e})") from None


def dequantize_tensor(tensor, source: str = "gguf") -> np.ndarray:
    """Dequantizes one ``gguf`` ``ReaderTensor`` to float32 in numpy order.

    Args:
      tensor: an entry of ``GGUFReader.tensors``.
      source: the file name, for error messages.
    Returns:
      ``np.ndarray`` float32 of shape ``tuple(reversed(tensor.shape))``.
    Raises:
      DFlashError: unsupported quantization type, or data that does not match the declared shape
        (a truncated file); the message names the file and tensor.
    """
    import gguf

    where = f"{source}: tensor {tensor.name}"
    shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))
    qtype = tensor.tensor_type
    try:
        if qtype == gguf.GGMLQuantizationType.F32:
            out = np.array(tensor.data, dtype=np.float32)  # a copy, not a view of the memory map
        elif qtype == gguf.GGMLQuantizationType.F16:
            out = np.asarray(tensor.data).view(np.float16).astype(np.float32)
        else:
            out = gguf.quants.dequantize(np.asarray(tensor.data), qtype).astype(np.float32, copy=False)
    except NotImplementedError:
        raise DFlashError(where, f"quantization type {qtype.name} cannot be dequantized", "F32/F16/BF16/Q*_0/Q*_1/Q*_K") from None
    except Exception as e:
        raise DFlashError(where, f"cannot decode {qtype.name} data ({type(e).__name__}: {e})") from None
    if out.size != math.prod(shape):
        raise DFlashError(where, f"{out.size} values for shape {list(shape)} (truncated file?)", f"{math.prod(shape)}")
    return out.reshape(shape)


def as_f32(value) -> float:
    """GGUF stores floats as float32: take the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def tensor_table(reader, path: str) -> dict:
    """``{name: ReaderTensor}`` of a GGUF file; raises DFlashError naming a name that appears twice."""
    tensors: dict = {}
    for t in reader.tensors:
        if t.name in tensors:
            raise DFlashError(f"{path}: tensor {t.name}", "appears twice", "unique tensor names")
        tensors[t.name] = t
    return tensors


def embedding_vocab(reader, tensors: dict, path: str, vocab_key: str) -> int:
    """Rows of ``token_embd.weight`` (ggml ``[hidden, vocab]``), checked against the tokenizer's
    token count and the ``vocab_key`` metadata when present.

    Raises:
      DFlashError: a missing or non-2-D embedding, or a disagreeing count (names file and key).
    """
    if "token_embd.weight" not in tensors:
        raise DFlashError(f"{path}: tensor token_embd.weight", "missing", "the token embedding")
    emb = [int(x) for x in tensors["token_embd.weight"].shape]  # ggml order [H, V]
    if len(emb) != 2:
        raise DFlashError(f"{path}: tensor token_embd.weight", f"ggml shape {emb}", "2 dims [hidden, vocab]")
    vocab = emb[1]
    field = reader.fields.get("tokenizer.ggml.tokens")
    n_tok = None if field is None else len(field.data)
    if n_tok is not None and n_tok != vocab:
        raise DFlashError(f"{path}: tokenizer.ggml.tokens", f"{n_tok} tokens but tensor token_embd.weight has {vocab} rows", "equal sizes")
    declared = metadata(reader, vocab_key)
    if declared is not None and declared != vocab:
        raise DFlashError(f"{path}: metadata {vocab_key}", f"{declared} but tensor token_embd.weight has {vocab} rows", "equal sizes")
    return vocab


def empty_params(path: str, tensors: dict, names, shapes: dict, dtype: np.dtype, model: str, dtype_of=None) -> dict:
    """The empty parameter tree a family's GGUF loader fills, once the file holds exactly the
    tensors ``names`` lists (arguments as :func:`read_params`'s; ``names`` any collection of
    tensor names).

    Raises:
      DFlashError: a missing or unexpected tensor (file and tensor named).
    """
    for name in sorted(set(names) - set(tensors)):
        raise DFlashError(f"{path}: tensor {name}", "missing", f"every tensor of {model}")
    for name in sorted(set(tensors) - set(names)):
        raise DFlashError(f"{path}: tensor {name}", "unexpected", f"only the tensors of {model}")
    dt = dtype_of or (lambda leaf: dtype)
    return {k: (np.empty(v, dtype) if isinstance(v, tuple) else {leaf: np.empty(s, dt(leaf)) for leaf, s in v.items()})
            for k, v in shapes.items()}


def read_params(path: str, tensors: dict, names: dict, shapes: dict, dtype: np.dtype, model: str, dtype_of=None) -> dict:
    """The parameter tree of a family's GGUF loader, every array read from its tensor.

    Args:
      path: the file (named in errors); tensors: its tensor table (:func:`tensor_table`).
      names: ``{gguf tensor name: (params key, leaf or None, layer index r or None, conv)}``:
        the tensor fills ``params[key][leaf][r]`` (``[key]`` without a leaf, the whole array
        without ``r``), stored transposed (``conv == "T"``), with its last two axes swapped
        (``"E"``: stacked experts ``[E, out, in]``) or as is.
      shapes: the family's ``param_shapes`` (a shape tuple, or ``{leaf: shape}``, per key).
      dtype: numpy dtype of the arrays; ``dtype_of``: ``leaf -> dtype`` where some differ.
      model: what the file must be, for errors (``"a 24-layer gpt-oss model"``).
    Returns:
      The tree of numpy arrays.
    Raises:
      DFlashError: a missing, unexpected or mis-shaped tensor (file and tensor named).
    """
    out = empty_params(path, tensors, names, shapes, dtype, model, dtype_of)
    for name, (key, leaf, r, conv) in names.items():
        dst = out[key] if not leaf else out[key][leaf]
        want = dst.shape if r is None else dst.shape[1:]
        stored = tuple(reversed(want)) if conv == "T" else (want[0], want[2], want[1]) if conv == "E" else want
        x = dequantize_tensor(tensors[name], path)
        if tuple(x.shape) != stored:
            raise DFlashError(f"{path}: tensor {name}", f"ggml shape {list(reversed(x.shape))}", f"{list(reversed(stored))} for this config")
        x = x.T if conv == "T" else np.swapaxes(x, 1, 2) if conv == "E" else x
        if r is None:
            dst[...] = x
        else:
            dst[r] = x
    return out
