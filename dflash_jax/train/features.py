"""Target features for training: computed by the frozen target (the residual stream after each
captured layer, ``docs/specs/dflash.md`` 3.2), either inside every step (:func:`target_features`)
or once for a whole dataset (:func:`cache_features`, :class:`FeatureCache`), and fingerprints of
parameter trees that tie a cache to its target.

On disk::

    <features>/features.npy   [T, K*H] uint16  bfloat16 bit patterns, row = token of tokens.npy
    <features>/features.json  layer ids, hidden size, target fingerprint, dataset fingerprint
    <features>/index.npz      per-sequence token hashes and offsets (lets a grown dataset reuse rows)
    <features>/next_tokens.npy [T] int32  optional: the target's greedy next token after each
                              position (argmax of its logits), the labels of ``labels="target"``

The cache stores bfloat16 (float16 overflows: SmolLM2's residual reaches ~2.5e4).
"""

from __future__ import annotations

import functools
import json
import os
import time
import zipfile
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dflash_jax.runtime.carry import init_capture
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.runtime.fingerprint import tree_fingerprint
from dflash_jax.formats.files import atomic_path, save_npy, write_text
from dflash_jax.families.registry import module_for
from dflash_jax.train.dataset import TokenDataset


def target_features(target_params, target_cfg: TargetConfig, tokens: jnp.ndarray, layer_ids: tuple, post_norm_last: bool = False,
                    next_tokens: bool = False):
    """Captured target features of every position of a right-padded batch (pure, jit-able).

    Args:
      tokens: ``[B, S]`` int32 (padding after each sequence's end is harmless: the target is causal).
      layer_ids: static tuple of captured target layer ids (HF convention: id ``i`` is
        ``hidden_states[i + 1]``; ``dflash_jax.runtime.carry.Capture``).
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


def target_fingerprint(target_cfg: TargetConfig, target_params, samples: int = 4096) -> str:
    """A short fingerprint of a target (hex, 16 chars): its config, and the name, shape and about
    ``samples`` evenly strided float32 values of every parameter (so a fine-tune that leaves
    some tensors unchanged still gets a fingerprint of its own). The same for stacked and
    per-layer (:func:`dflash_jax.nn.params.unstack_layers`) parameters."""
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
        old = FeatureCache.reusable(folder, tfp, layer_ids, post_norm_last, next_tokens)
        todo = _copy_rows(old, dataset, hashes, out, nxt) if old is not None else np.ones(len(dataset), bool)
        reused = int(lens[~todo].sum())
        order = np.array([j for j in np.argsort(lens, kind="stable") if todo[j]], np.int64)
        bar = tqdm(total=int(lens[todo].sum()), unit="tok", desc="target features", disable=not progress, mininterval=2.0)
        for idx, feats, nt in _forward_batches(target_params, target_cfg, dataset, order, layer_ids, post_norm_last, next_tokens,
                                               tokens_per_batch, round_to):
            for r, j in enumerate(idx):
                a = dataset.offsets[j]
                out[a : a + lens[j]] = feats[r, : lens[j]]
                if nxt is not None:
                    nxt[a : a + lens[j]] = nt[r, : lens[j]]
            bar.update(int(lens[idx].sum()))
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


def _copy_rows(old: tuple[FeatureCache, dict], dataset: TokenDataset, hashes, out: np.ndarray, nxt: np.ndarray | None) -> np.ndarray:
    """Copies into ``out`` (and ``nxt``) the rows of every sequence the old cache holds with the
    same tokens; returns the ``[n]`` bool mask of sequences still to compute."""
    cache, where = old
    old_bits = cache.features.view(np.uint16)
    lens = dataset.lengths
    todo = np.ones(len(dataset), bool)
    for j, h in enumerate(hashes):
        hit = where.get(int(h))
        if hit is not None and hit[1] == lens[j]:
            a = dataset.offsets[j]
            out[a : a + lens[j]] = old_bits[hit[0] : hit[0] + hit[1]]
            if nxt is not None:
                nxt[a : a + lens[j]] = cache.next_tokens[hit[0] : hit[0] + hit[1]]
            todo[j] = False
    return todo


def _forward_batches(target_params, target_cfg, dataset, order, layer_ids, post_norm_last, next_tokens, tokens_per_batch, round_to):
    """Yields ``(sequence ids, feature bits [b, s, K*H] uint16, next tokens [b, s] or None)`` for
    the sequences ``order`` (sorted by length) in batches of about ``tokens_per_batch`` padded
    tokens, lengths padded to a multiple of ``round_to``."""
    lens = dataset.lengths
    i = 0
    while i < len(order):
        s = int(-(-max(int(lens[order[i]]), 1) // round_to) * round_to)
        idx = order[i : i + max(1, tokens_per_batch // s)]
        s = int(-(-max(int(lens[idx].max()), 1) // round_to) * round_to)
        toks = np.zeros((len(idx), s), np.int32)
        for r, j in enumerate(idx):
            toks[r, : lens[j]] = dataset.sequence(j)[0]
        feats, nt = jax.device_get(_features_jit(target_params, target_cfg, jnp.asarray(toks), layer_ids, post_norm_last, next_tokens))
        yield idx, np.asarray(feats).view(np.uint16), nt
        i += len(idx)
