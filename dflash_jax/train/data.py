"""Training batches: deterministic, stateless batches of a dataset with optional cached features.

Datasets live in :mod:`dflash_jax.train.dataset`, target features and their cache in
:mod:`dflash_jax.train.features` (both re-exported here; each gives its on-disk layout).

Labels: by default slot ``k`` of a block learns the data's own token ``x[a + k]`` (``"data"``),
right for self-distilled answers, which are the target's greedy output. For other text (source
code, documents) the token the drafter must match at verification is the target's greedy
choice, not the text's: ``labels="target"`` labels position ``q`` with the target's argmax after
``x[:q]``, read from a cache built with ``next_tokens=True`` (same forward, no extra pass).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.train.dataset import TokenDataset
from dflash_jax.train.features import (  # noqa: F401 (re-exported)
    FeatureCache,
    cache_features,
    target_features,
    target_fingerprint,
    tree_fingerprint,
)

LABELS = ("data", "target")
__all__ = ["LABELS", "Batcher", "FeatureCache", "TokenDataset", "cache_features", "count_valid_anchors", "target_features",
           "target_fingerprint", "tree_fingerprint"]


class Batcher:
    """Deterministic, stateless batches: batch ``i`` depends only on ``(seed, i)``.

    Sample ``g = i * batch_size + r`` of the stream is sequence ``perm_e[g mod n]`` with
    ``e = g // n`` and ``perm_e`` a permutation drawn from ``numpy.random.default_rng([seed, e])``
    (a fresh shuffle every epoch). The data cursor of a checkpoint is therefore just the step.
    Sequences with no valid anchor (fewer than 2 consecutive supervised tokens,
    ``docs/specs/dflash.md`` 3.8 item 7) are skipped; longer ones are truncated to ``max_len``.

    Args:
      dataset: the :class:`TokenDataset`.
      batch_size: sequences per batch.
      max_len: static padded length ``S`` of every batch.
      seed: shuffle seed.
      features: optional :class:`FeatureCache`; batches then carry ``features``.
      labels: ``"data"`` (slot labels are the data's tokens) or ``"target"`` (the target's greedy
        next tokens of the feature cache; batches then carry ``labels``).
    Raises:
      DFlashError: no usable sequence; ``labels="target"`` without a cache holding next tokens.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, max_len: int, seed: int = 0, features: FeatureCache | None = None,
                 labels: str = "data"):
        self.dataset, self.batch_size, self.max_len, self.seed, self.features = dataset, int(batch_size), int(max_len), int(seed), features
        if labels not in LABELS:
            raise DFlashError("labels (--labels)", f"got {labels!r}", f"one of {LABELS}")
        if labels == "target" and (features is None or features.next_tokens is None):
            raise DFlashError("labels (--labels)", "'target' without a feature cache holding the target's next tokens",
                              "a cache built by cache_features(..., next_tokens=True) (dflash-jax train builds one)")
        self.labels = labels
        self._flat_labels = None if labels == "data" else self._shifted_next_tokens()
        keep = []
        for i in range(len(dataset)):
            m = dataset.sequence(i)[1][: self.max_len]
            if len(m) >= 2 and bool(np.any((m[:-1] > 0) & (m[1:] > 0))):
                keep.append(i)
        if not keep:
            raise DFlashError(f"{dataset.source}", "no sequence has two consecutive supervised tokens", "a dataset with responses")
        self.index = np.asarray(keep, np.int64)
        self._perm_cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Usable sequences (one epoch)."""
        return len(self.index)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: self.index[np.random.default_rng([self.seed, epoch]).permutation(len(self.index))]}
        return self._perm_cache[epoch]

    def flat_labels(self) -> np.ndarray:
        """``[T]`` int32: the label of every token of the dataset (aligned with ``dataset.tokens``
        and its ``loss_mask``): the token itself, or with ``labels="target"`` the target's greedy
        next token after the previous position (a sequence's first token keeps its own)."""
        return self.dataset.tokens if self._flat_labels is None else self._flat_labels

    def _shifted_next_tokens(self) -> np.ndarray:
        out = np.empty_like(self.dataset.tokens)
        out[1:] = self.features.next_tokens[:-1]
        starts = self.dataset.offsets[:-1][self.dataset.lengths > 0]
        out[starts] = self.dataset.tokens[starts]
        return out

    def cursor(self, step: int) -> dict:
        """``{"sample": g, "epoch": e, "offset": g mod n}`` at the start of batch ``step``."""
        g = int(step) * self.batch_size
        return {"sample": g, "epoch": g // len(self), "offset": g % len(self)}

    def sequence_ids(self, step: int) -> np.ndarray:
        """``[batch_size]`` dataset indices of batch ``step``."""
        n = len(self)
        g = int(step) * self.batch_size + np.arange(self.batch_size)
        return np.asarray([self._perm(int(x // n))[int(x % n)] for x in g], np.int64)

    def counts(self, step: int) -> tuple[int, int]:
        """``(tokens, supervised tokens)`` of batch ``step``, all its rows (after truncation to
        ``max_len``), without building the batch."""
        tokens = supervised = 0
        for j in self.sequence_ids(step):
            m = self.dataset.sequence(int(j))[1][: self.max_len]
            tokens, supervised = tokens + len(m), supervised + int(np.sum(m, dtype=np.int64))
        return tokens, supervised

    def batch(self, step: int, rows: tuple[int, int] | None = None) -> dict:
        """Batch ``step`` as numpy arrays (right-padded to ``max_len``).

        Args:
          rows: ``(lo, hi)``: only rows ``lo:hi`` of the batch (one process's share on a device
            mesh, :mod:`dflash_jax.train.mesh`); default all ``batch_size`` rows.
        Returns:
          ``tokens [B, S]`` int32, ``loss_mask [B, S]`` float32 (0 on padding), ``lengths [B]``
          int32, ``features [B, S, K*H]`` bfloat16 (zeros on padding) with a cache, and with
          ``labels="target"`` ``labels [B, S]`` int32 (position ``q`` of a row: the target's greedy
          next token after position ``q - 1``). ``B`` is ``hi - lo`` with ``rows``.
        Raises:
          DFlashError: ``rows`` outside ``[0, batch_size]`` or empty.
        """
        ids = self.sequence_ids(step)
        if rows is not None:
            lo, hi = map(int, rows)
            if not 0 <= lo < hi <= self.batch_size:
                raise DFlashError("Batcher.batch rows", f"{lo}:{hi}", f"a non-empty range within 0:{self.batch_size}")
            ids = ids[lo:hi]
        b, s = len(ids), self.max_len
        toks = np.zeros((b, s), np.int32)
        mask = np.zeros((b, s), np.float32)
        lens = np.zeros((b,), np.int32)
        feats = None
        if self.features is not None:
            feats = np.zeros((b, s, self.features.features.shape[1]), ml_dtypes.bfloat16)
        labs = np.zeros((b, s), np.int32) if self.labels == "target" else None
        for r, j in enumerate(ids):
            t, m = self.dataset.sequence(int(j))
            n = min(len(t), s)
            toks[r, :n], mask[r, :n], lens[r] = t[:n], m[:n], n
            if feats is not None:
                a = int(self.dataset.offsets[j])
                feats[r, :n] = self.features.features[a : a + n]
                if labs is not None:
                    labs[r, :n] = self._flat_labels[a : a + n]
        out = {"tokens": toks, "loss_mask": mask, "lengths": lens}
        if feats is not None:
            out["features"] = feats
        if labs is not None:
            out["labels"] = labs
        return out


def count_valid_anchors(dataset: TokenDataset, max_len: int) -> int:
    """Total valid anchor positions of the dataset (sequences truncated to ``max_len``; the rule
    of :func:`dflash_jax.train.objective.valid_anchors`)."""
    total = 0
    for i in range(len(dataset)):
        m = dataset.sequence(i)[1][:max_len] > 0
        total += int(np.sum(m[:-1] & m[1:]))
    return total
