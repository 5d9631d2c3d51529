"""Training data: token-id sequences with loss masks, cached target features, deterministic batches.

On disk (never pickle; every array is loaded with ``allow_pickle=False``)::

    <dataset>/tokens.npy      [T] int32   all sequences concatenated
    <dataset>/loss_mask.npy   [T] uint8   1 on supervised (response) tokens
    <dataset>/offsets.npy     [n + 1] int64  sequence i is tokens[offsets[i]:offsets[i + 1]]
    <dataset>/meta.json       recipe, tokenizer and generation settings (free-form)

    <features>/features.npy   [T, K*H] uint16  bfloat16 bit patterns, row = token of tokens.npy
    <features>/features.json  layer ids, hidden size, target fingerprint, dataset fingerprint
    <features>/index.npz      per-sequence token hashes and offsets (lets a grown dataset reuse rows)
    <features>/next_tokens.npy [T] int32  optional: the target's greedy next token after each
                              position (argmax of its logits), the labels of ``labels="target"``

Target features are the residual stream after each captured target layer (``docs/specs/dflash.md``
3.2), computed with :func:`target_features` (``dense.forward_hidden`` with a ``Capture``). They
are either recomputed inside every training step or cached once with :func:`cache_features`;
the cache stores bfloat16 (float16 overflows: SmolLM2's residual reaches ~2.5e4).

Labels: by default slot ``k`` of a block learns the data's own token ``x[a + k]`` (``"data"``),
right for self-distilled answers, which are the target's greedy output. For other text (source
code, documents) the token the drafter must match at verification is the target's greedy
choice, not the text's: ``labels="target"`` labels position ``q`` with the target's argmax after
``x[:q]``, read from a cache built with ``next_tokens=True`` (same forward, no extra pass).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
import zipfile
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.io.files import atomic_path, save_npy, write_text
from dflash_jax.cache import init_capture
from dflash_jax.config import TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.registry import module_for


LABELS = ("data", "target")


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


def target_features(target_params, target_cfg: TargetConfig, tokens: jnp.ndarray, layer_ids: tuple, post_norm_last: bool = False,
                    next_tokens: bool = False):
    """Captured target features of every position of a right-padded batch (pure, jit-able).

    Args:
      tokens: ``[B, S]`` int32 (padding after each sequence's end is harmless: the target is causal).
      layer_ids: static tuple of captured target layer ids (HF convention: id ``i`` is
        ``hidden_states[i + 1]``; ``dflash_jax.cache.Capture``).
      post_norm_last: read the target's last layer after its final norm.
      next_tokens: also return the target's greedy next token after every position.
    Returns:
      ``[B, S, len(layer_ids) * H]`` in ``target_cfg.dtype``, slot = position; with
      ``next_tokens`` a pair ``(features, next [B, S] int32)``, ``next[b, q] = argmax`` of the
      target's logits at position ``q`` (its prediction for position ``q + 1``).
    Source: ``docs/specs/dflash.md`` 3.2; same capture as speculative prefill.
    """
    mod = module_for(target_cfg)
    b, s = tokens.shape
    cap = init_capture(layer_ids, b, s, target_cfg.hidden_size, target_cfg.dtype, post_norm_last=post_norm_last)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    h, _, cap = mod.forward_hidden(target_params, target_cfg, tokens, pos, mod.init_cache(target_cfg, b, s), cap)
    if not next_tokens:
        return cap.hidden
    return cap.hidden, jnp.argmax(mod.lm_head(target_params, target_cfg, h), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("target_cfg", "layer_ids", "post_norm_last", "next_tokens"))
def _features_jit(target_params, target_cfg, tokens, layer_ids, post_norm_last, next_tokens):
    out = target_features(target_params, target_cfg, tokens, layer_ids, post_norm_last, next_tokens)
    return (out[0].astype(jnp.bfloat16), out[1]) if next_tokens else (out.astype(jnp.bfloat16), None)


class FeatureCache:
    """Cached bfloat16 target features aligned with a :class:`TokenDataset` (read via memmap).

    Attributes:
      features: ``[T, K*H]`` ``ml_dtypes.bfloat16`` view; meta: dict (``layer_ids``,
      ``hidden_size``, ``dataset``, ``target``, ``next_tokens``).
      next_tokens: ``[T]`` int32, the target's greedy next token after each position, or ``None``
        (a cache built without ``next_tokens=True``).
    """

    def __init__(self, features: np.ndarray, meta: dict, next_tokens: np.ndarray | None = None):
        self.features = features
        self.meta = meta
        self.next_tokens = next_tokens

    @property
    def layer_ids(self) -> tuple:
        return tuple(self.meta["layer_ids"])

    @classmethod
    def load(cls, folder: str | os.PathLike, dataset: TokenDataset | None = None, layer_ids=None, target: str | None = None) -> "FeatureCache":
        """Opens a cache written by :func:`cache_features`, checked against what is given.

        Args:
          target: :func:`target_fingerprint` of the target the features must come from.
        Raises:
          DFlashError: missing files, or a cache built for another dataset, other layer ids or
            another target.
        """
        folder = Path(folder)
        meta_path = folder / "features.json"
        if not meta_path.is_file():
            raise DFlashError(str(meta_path), "file not found", "a feature cache written by cache_features")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        raw = np.load(folder / "features.npy", mmap_mode="r", allow_pickle=False)
        if dataset is not None:
            if meta.get("dataset") != dataset.fingerprint() or raw.shape[0] != len(dataset.tokens):
                raise DFlashError(str(meta_path), "built for another dataset", f"dataset fingerprint {dataset.fingerprint()}")
        if layer_ids is not None and tuple(meta["layer_ids"]) != tuple(layer_ids):
            raise DFlashError(str(meta_path), f"layer ids {meta['layer_ids']}", f"{list(layer_ids)} (the drafter's target_layer_ids)")
        if target is not None and meta.get("target") != target:
            raise DFlashError(str(meta_path), f"built for target {meta.get('target')}", f"target {target} (target_fingerprint)")
        nxt = None
        if meta.get("next_tokens"):
            nxt = np.load(folder / "next_tokens.npy", mmap_mode="r", allow_pickle=False)
            if nxt.shape != raw.shape[:1]:
                raise DFlashError(str(folder / "next_tokens.npy"), f"shape {nxt.shape}", f"({raw.shape[0]},), one per feature row")
        return cls(raw.view(ml_dtypes.bfloat16), meta, nxt)

    @classmethod
    def reusable(cls, folder: str | os.PathLike, target_fp: str, layer_ids, post_norm_last: bool,
                 next_tokens: bool = False) -> tuple["FeatureCache", dict] | None:
        """An existing cache in ``folder`` whose rows a new dataset may copy: same target, layer
        ids and ``post_norm_last``, holding next tokens when they are wanted, with its sequence
        index (``index.npz``); ``None`` otherwise.
        Returns ``(cache, {sequence hash: (offset, length)})``."""
        folder = Path(folder)
        try:
            cache = cls.load(folder, layer_ids=layer_ids, target=target_fp)
            with np.load(folder / "index.npz", allow_pickle=False) as z:
                off, hashes, dataset = z["offsets"], z["hashes"], z["dataset"].tobytes().decode()
        except (DFlashError, OSError, ValueError, KeyError, zipfile.BadZipFile):
            return None
        if bool(cache.meta.get("post_norm_last")) != bool(post_norm_last) or dataset != cache.meta.get("dataset"):
            return None
        if next_tokens and cache.next_tokens is None:
            return None
        if len(off) != len(hashes) + 1 or int(off[-1]) != cache.features.shape[0]:
            return None
        return cache, {int(h): (int(off[i]), int(off[i + 1] - off[i])) for i, h in enumerate(hashes)}


class _StackedLeaf:
    """The per-layer buffers of one weight, read as the ``[L, ...]`` leaf they stack to."""

    def __init__(self, parts):
        self.parts = parts


def tree_fingerprint(tree, prefix: bytes = b"", samples: int | None = None) -> str:
    """sha256 (hex, 16 chars) of ``prefix`` then, leaf by leaf, each leaf's name and shape and its
    float32 values: all of them, or about ``samples`` evenly strided ones (row-major order).

    Per-layer parameters (``"layers"`` a tuple of dicts, :func:`dflash_jax.models.dense.unstack_layers`)
    hash as the stacked leaves they stand for, read in place (no stacked copy), so both layouts
    of one model have one fingerprint."""
    layers = tree.get("layers") if isinstance(tree, dict) else None
    if isinstance(layers, (tuple, list)):
        tree = dict(tree, layers=jax.tree_util.tree_map(lambda *a: _StackedLeaf(a), *layers))
    h = hashlib.sha256(prefix)
    for k, v in jax.tree_util.tree_leaves_with_path(tree):
        parts = v.parts if isinstance(v, _StackedLeaf) else (v,)
        shape = ((len(parts),) if isinstance(v, _StackedLeaf) else ()) + tuple(np.shape(parts[0]))
        size = math.prod(shape)
        step = 1 if samples is None else max(1, size // samples)
        h.update(f"{jax.tree_util.keystr(k)}{shape}".encode())
        for i, part in enumerate(parts):  # the stacked leaf's strided samples that fall in layer i
            start = (-i * (size // len(parts))) % step
            h.update(np.asarray(jax.device_get(jnp.ravel(part)[start::step]), np.float32).tobytes())
    return h.hexdigest()[:16]


def target_fingerprint(target_cfg: TargetConfig, target_params, samples: int = 4096) -> str:
    """A short fingerprint of a target (hex, 16 chars): its config, and the name, shape and about
    ``samples`` evenly strided float32 values of every parameter (so a fine-tune that leaves
    some tensors unchanged still gets a fingerprint of its own). The same for stacked and
    per-layer (:func:`dflash_jax.models.dense.unstack_layers`) parameters."""
    return tree_fingerprint(target_params, repr(target_cfg.with_dtype("float32")).encode(), samples)


def cache_features(
    target_params,
    target_cfg: TargetConfig,
    dataset: TokenDataset,
    layer_ids: Sequence[int],
    folder: str | os.PathLike,
    *,
    post_norm_last: bool = False,
    next_tokens: bool = False,
    tokens_per_batch: int = 4096,
    round_to: int = 64,
    progress: bool = True,
) -> FeatureCache:
    """Runs the target once over every sequence and stores the captured features (bfloat16).

    Sequences are sorted by length and batched with about ``tokens_per_batch`` padded tokens per
    forward, padded to a multiple of ``round_to`` (few compilations). The array is written to a
    temporary file and renamed when complete, so an interrupted run leaves no partial cache.
    When ``folder`` already holds a cache of the same target and layers for another dataset
    (:meth:`FeatureCache.reusable`), the rows of every sequence it holds with identical token ids
    are copied instead of recomputed, so a dataset grown by new sequences only runs the target
    over those (a feature row depends only on its own sequence's tokens: the target is causal).

    Args:
      layer_ids: captured target layers (the drafter's ``target_layer_ids``).
      folder: output folder (created).
      next_tokens: also store the target's greedy next token after every position (one
        ``[T]`` int32 array from the same forward; the labels of ``labels="target"``).
    Returns:
      the opened :class:`FeatureCache`. Size: ``T * len(layer_ids) * H * 2`` bytes.
    """
    from tqdm import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layer_ids = tuple(int(i) for i in layer_ids)
    width = len(layer_ids) * target_cfg.hidden_size
    lens = dataset.lengths
    hashes = dataset.sequence_hashes()
    tfp = target_fingerprint(target_cfg, target_params)
    nxt = np.zeros(len(dataset.tokens), np.int32) if next_tokens else None
    with atomic_path(folder / "features.npy") as tmp:  # an interrupted run leaves the old cache as it was
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16, shape=(len(dataset.tokens), width))
        t0 = time.time()
        todo = np.ones(len(dataset), bool)
        old = FeatureCache.reusable(folder, tfp, layer_ids, post_norm_last, next_tokens)
        if old is not None:
            cache, where = old
            old_bits = cache.features.view(np.uint16)
            for j, h in enumerate(hashes):
                hit = where.get(int(h))
                if hit is not None and hit[1] == lens[j]:
                    a = dataset.offsets[j]
                    out[a : a + lens[j]] = old_bits[hit[0] : hit[0] + hit[1]]
                    if nxt is not None:
                        nxt[a : a + lens[j]] = cache.next_tokens[hit[0] : hit[0] + hit[1]]
                    todo[j] = False
        reused = int(lens[~todo].sum())
        order = np.array([j for j in np.argsort(lens, kind="stable") if todo[j]], np.int64)
        bar = tqdm(total=int(lens[todo].sum()), unit="tok", desc="target features", disable=not progress, mininterval=2.0)
        i = 0
        while i < len(order):
            s = int(-(-max(int(lens[order[i]]), 1) // round_to) * round_to)
            nb = max(1, tokens_per_batch // s)
            idx = order[i : i + nb]
            s = int(-(-max(int(lens[idx].max()), 1) // round_to) * round_to)
            toks = np.zeros((len(idx), s), np.int32)
            for r, j in enumerate(idx):
                toks[r, : lens[j]] = dataset.sequence(j)[0]
            feats, nt = jax.device_get(_features_jit(target_params, target_cfg, jnp.asarray(toks), layer_ids, post_norm_last, next_tokens))
            bits = np.asarray(feats).view(np.uint16)
            for r, j in enumerate(idx):
                a = dataset.offsets[j]
                out[a : a + lens[j]] = bits[r, : lens[j]]
                if nxt is not None:
                    nxt[a : a + lens[j]] = nt[r, : lens[j]]
            bar.update(int(lens[idx].sum()))
            i += len(idx)
        bar.close()
        out.flush()
        del out
        (folder / "features.json").unlink(missing_ok=True)  # never a json naming the wrong array
    if nxt is not None:
        save_npy(folder / "next_tokens.npy", nxt)
    else:
        (folder / "next_tokens.npy").unlink(missing_ok=True)  # an older build's
    with atomic_path(folder / "index.npz") as p, open(p, "wb") as f:
        np.savez(f, hashes=hashes, offsets=dataset.offsets, dataset=np.frombuffer(dataset.fingerprint().encode(), np.uint8))
    meta = {"layer_ids": list(layer_ids), "hidden_size": target_cfg.hidden_size, "dtype": "bfloat16",
            "post_norm_last": bool(post_norm_last), "next_tokens": bool(next_tokens), "dataset": dataset.fingerprint(), "target": tfp,
            "seconds": round(time.time() - t0, 1), "reused_tokens": reused}
    write_text(folder / "features.json", json.dumps(meta, indent=1))
    return FeatureCache.load(folder, dataset, layer_ids)


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

    def batch(self, step: int) -> dict:
        """Batch ``step`` as numpy arrays (right-padded to ``max_len``).

        Returns:
          ``tokens [B, S]`` int32, ``loss_mask [B, S]`` float32 (0 on padding), ``lengths [B]``
          int32, ``features [B, S, K*H]`` bfloat16 (zeros on padding) with a cache, and with
          ``labels="target"`` ``labels [B, S]`` int32 (position ``q`` of a row: the target's greedy
          next token after position ``q - 1``).
        """
        ids = self.sequence_ids(step)
        b, s = self.batch_size, self.max_len
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
