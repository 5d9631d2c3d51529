"""Reduced draft vocabulary: the drafter scores only the target tokens it is likely to draft.

A DFlash drafter reads its logits through the target's LM head (``[H, V]``, V = 49152 for
SmolLM2). Over a block of 15 draft slots that head costs more than the drafter's layers, in
training (forward and backward of every block slot) and at inference (every propose). A draft
vocabulary is a sorted list of ``Vd`` target token ids; the drafter then scores only those
columns of the target head (``draft_head [H, Vd]``, run through the target family's LM head so
a family soft-cap applies as on the full head) and maps its choice back to target ids
(``draft_ids [Vd]``). Verification is untouched, so greedy output stays the target's and
sampling stays exact (the proposal simply puts no mass outside the list). EAGLE-3 drafts over a
reduced vocabulary the same way (its ``d2t`` table).

The list is stored next to a z-lab checkpoint as ``draft_vocab.safetensors`` (one int32 tensor
``draft_ids``), so the checkpoint itself stays loadable by the reference ``dflash`` package,
which ignores the extra file and drafts over the full vocabulary.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
import jax.numpy as jnp
import numpy as np
from dflash_jax.errors import DFlashError
from dflash_jax.nn import quant


FILE_NAME = "draft_vocab.safetensors"
TENSOR_NAME = "draft_ids"


def most_frequent(tokens: np.ndarray, loss_mask: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` token ids most frequent among supervised tokens, sorted ascending.

    Args:
      tokens: ``[T]`` int token ids; loss_mask: ``[T]`` (nonzero = a response token the drafter
        is trained to draft).
      size: ``Vd``, at most ``vocab_size``; ties in frequency go to the smaller id, so the
        choice is deterministic.
    Returns:
      ``[Vd]`` int32 ids.
    Raises:
      DFlashError: ``size`` outside ``[1, vocab_size]``.
    """
    if not 1 <= int(size) <= int(vocab_size):
        raise DFlashError("draft_vocab (--draft-vocab)", f"got {size}", f"a size in [1, {vocab_size}] (the target's vocabulary)")
    sup = np.asarray(tokens)[np.asarray(loss_mask) > 0]
    counts = np.bincount(sup, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id ascending
    return np.sort(order[: int(size)]).astype(np.int32)


def check_ids(ids, vocab_size: int, where: str) -> np.ndarray:
    """Validates a draft vocabulary: 1-D, strictly increasing, inside ``[0, vocab_size)``.

    Raises:
      DFlashError: naming ``where`` and what was wrong.
    """
    a = np.asarray(ids)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise DFlashError(where, f"shape {a.shape} dtype {a.dtype}", "a non-empty 1-D integer array of token ids")
    if (np.diff(a) <= 0).any():
        raise DFlashError(where, "ids not strictly increasing", "sorted, unique token ids")
    if a[0] < 0 or a[-1] >= vocab_size:
        raise DFlashError(where, f"ids span [{a[0]}, {a[-1]}]", f"ids in [0, {vocab_size}) (the target's vocabulary)")
    return a.astype(np.int32)


def save(folder: str | os.PathLike, ids) -> Path:
    """Writes ``<folder>/draft_vocab.safetensors`` (``draft_ids [Vd]`` int32) atomically."""
    from dflash_jax.formats.files import write_safetensors

    return write_safetensors(Path(folder) / FILE_NAME, {TENSOR_NAME: np.asarray(ids, np.int32)}, {"format": "pt"})


def load(folder: str | os.PathLike, vocab_size: int) -> np.ndarray | None:
    """The draft vocabulary stored in a drafter folder, or ``None`` when it has none.

    Raises:
      DFlashError: an unreadable (truncated, corrupt) file, a file without ``draft_ids`` or with
        invalid ids (names the file).
    """
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return None
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own SafetensorError, OSError or ValueError
        raise DFlashError(str(path), f"unreadable safetensors file ({type(e).__name__}: {e})", f"a safetensors file holding {TENSOR_NAME!r}") from None
    if TENSOR_NAME not in tensors:
        raise DFlashError(str(path), f"tensors {sorted(tensors)}", f"a tensor named {TENSOR_NAME!r}")
    return check_ids(tensors[TENSOR_NAME], vocab_size, f"{path}: {TENSOR_NAME}")


def head_columns(target_params: dict, ids: jnp.ndarray) -> jnp.ndarray:
    """``[H, Vd]``: the target LM-head columns of ``ids`` (tied heads read the embedding rows); the
    drafter's logits run them through the target family's ``lm_head`` (any soft-cap applies:
    :func:`dflash_jax.drafter.model.head_logits`). A quantized head gives its columns dequantized."""
    head = target_params["lm_head"] if "lm_head" in target_params else target_params["embed"]
    if quant.is_quantized(head):  # rows = vocabulary (an [H, V] head or a tied [V, H] embedding alike)
        return jnp.transpose(quant.take_rows(head, ids))
    if "lm_head" in target_params:
        return jnp.take(head, ids, axis=1)
    return jnp.transpose(jnp.take(head, ids, axis=0))


def attach(cfg, params: dict, target_params: dict, ids) -> tuple:
    """A drafter that drafts over ``ids`` only.

    Args:
      cfg: :class:`~dflash_jax.drafter.config.DrafterConfig` with ``draft_vocab_size == 0``.
      params: its parameter pytree.
      target_params: the target's (the head columns are copied once, here).
      ids: ``[Vd]`` sorted target token ids (:func:`check_ids`).
    Returns:
      ``(cfg, params)`` with ``cfg.draft_vocab_size = Vd`` and ``params`` gaining
      ``draft_ids [Vd]`` int32 and ``draft_head [H, Vd]`` (the target head's dtype).
    """
    ids = jnp.asarray(check_ids(ids, cfg.vocab_size, "draft vocabulary"))
    params = dict(params, draft_ids=ids, draft_head=head_columns(target_params, ids))
    return dataclasses.replace(cfg, draft_vocab_size=int(ids.shape[0])), params


def coverage(ids, tokens: np.ndarray, loss_mask: np.ndarray) -> float:
    """Fraction of supervised tokens whose id is in ``ids`` (1.0 = the list drafts every label)."""
    sup = np.asarray(tokens)[np.asarray(loss_mask) > 0]
    return float(np.isin(sup, np.asarray(ids)).mean()) if sup.size else 1.0
