"""Training datasets: token-id sequences with per-token loss masks, stored as flat arrays.

On disk (never pickle; every array is loaded with ``allow_pickle=False``)::

    <dataset>/tokens.npy      [T] int32   all sequences concatenated
    <dataset>/loss_mask.npy   [T] uint8   1 on supervised (response) tokens
    <dataset>/offsets.npy     [n + 1] int64  sequence i is tokens[offsets[i]:offsets[i + 1]]
    <dataset>/meta.json       recipe, tokenizer and generation settings (free-form)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.formats.files import save_npy, write_text

class TokenDataset:
    """Sequences of token ids with per-token loss masks (flat arrays + offsets).

    Attributes:
      tokens: ``[T]`` int32; loss_mask: ``[T]`` uint8; offsets: ``[n + 1]`` int64; meta: dict.
    Raises (on construction):
      DFlashError: inconsistent array lengths or offsets.
    """

    def __init__(self, tokens: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, meta: dict | None = None, source: str = "dataset"):
        self.tokens = np.asarray(tokens, np.int32)
        self.loss_mask = np.asarray(loss_mask, np.uint8)
        self.offsets = np.asarray(offsets, np.int64)
        self.meta = dict(meta or {})
        self.source = source
        if self.tokens.ndim != 1 or self.loss_mask.shape != self.tokens.shape:
            raise DFlashError(f"{source}: loss_mask", f"shape {self.loss_mask.shape} vs tokens {self.tokens.shape}", "equal 1-D shapes")
        o = self.offsets
        if o.ndim != 1 or len(o) < 1 or o[0] != 0 or o[-1] != len(self.tokens) or (np.diff(o) < 0).any():
            raise DFlashError(f"{source}: offsets", "not a non-decreasing list from 0 to len(tokens)", "valid sequence offsets")

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], meta: dict | None = None) -> "TokenDataset":
        """Builds a dataset from per-sequence token lists and 0/1 loss-mask lists of equal lengths."""
        lens = [len(s) for s in sequences]
        if [len(m) for m in masks] != lens:
            raise DFlashError("dataset: loss_mask", "a mask whose length differs from its sequence", "equal lengths")
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        tok = np.concatenate([np.asarray(s, np.int32) for s in sequences]) if sequences else np.zeros(0, np.int32)
        msk = np.concatenate([np.asarray(m, np.uint8) for m in masks]) if masks else np.zeros(0, np.uint8)
        return cls(tok, msk, offsets, meta)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """``[n]`` int64 sequence lengths."""
        return np.diff(self.offsets)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [L] int32, loss_mask [L] uint8)`` of sequence ``i``."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.loss_mask[a:b]

    def sequence_hashes(self) -> np.ndarray:
        """``[n]`` uint64: a hash of each sequence's token ids (blake2b, 8 bytes)."""
        return np.array([int.from_bytes(hashlib.blake2b(np.ascontiguousarray(self.sequence(i)[0], np.int32).tobytes(),
                                                        digest_size=8).digest(), "little") for i in range(len(self))], np.uint64)

    def fingerprint(self) -> str:
        """sha256 (hex, 16 chars) of the token, mask and offset arrays."""
        h = hashlib.sha256()
        for a in (self.tokens, self.loss_mask, self.offsets):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def save(self, folder: str | os.PathLike) -> Path:
        """Writes the four files (each atomically) into ``folder`` (created); returns the path."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_npy(folder / "tokens.npy", self.tokens)
        save_npy(folder / "loss_mask.npy", self.loss_mask)
        save_npy(folder / "offsets.npy", self.offsets)
        meta = dict(self.meta, num_sequences=len(self), num_tokens=int(len(self.tokens)),
                    num_supervised=int(self.loss_mask.sum()), fingerprint=self.fingerprint())
        write_text(folder / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "TokenDataset":
        """Reads a dataset folder written by :meth:`save`.

        Raises:
          DFlashError: a missing or malformed file (names the file).
        """
        folder = Path(folder)
        arrays = {}
        for name in ("tokens", "loss_mask", "offsets"):
            p = folder / f"{name}.npy"
            try:
                arrays[name] = np.load(p, allow_pickle=False)
            except FileNotFoundError:
                raise DFlashError(str(p), "file not found", "a dataset folder written by TokenDataset.save") from None
            except ValueError as e:
                raise DFlashError(str(p), f"not a plain .npy array ({e})") from None
        meta_path = folder / "meta.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
        return cls(arrays["tokens"], arrays["loss_mask"], arrays["offsets"], meta, source=str(folder))
