"""Checking and resolving the arguments of :func:`dflash_jax.generate` (errors name the argument
and its command-line option)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence
import numpy as np
from dflash_jax.decode.auto.costs import CostModel, depth_policy
from dflash_jax.decode.state import AUTO, Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.loading import Drafter, Target
from dflash_jax.decode.prefill import check_chunk_size
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.auto.policy import Calibration
from dflash_jax.text import split_stop


@dataclasses.dataclass(frozen=True)
class Request:
    """Checked arguments of one generation: what :func:`dflash_jax.decode.loop.init_state` and the
    driver need. ``chunk_size`` is the effective one (:func:`effective_chunk_size`), ``stop_ids``
    holds EOS (unless ignored), the given ids and the single-token stop texts. Under
    ``n_max="auto"``: the drafter's ``calibration`` (identity when it ships none) and the
    ``cost_model`` asked for (a :class:`~dflash_jax.decode.auto.costs.CostModel`, ``"refresh"`` or ``None``)."""

    prompts: list[list[int]]
    max_new_tokens: int
    max_len: int
    chunk_size: int
    stop_ids: tuple[int, ...]
    stop_texts: tuple[str, ...]
    seed: int
    sampling: SamplingConfig
    static: Decoding
    params: Params
    calibration: Calibration | None = None
    cost_model: CostModel | str | None = None


MIN_CAPACITY = 1024
"""The smallest default capacity; larger defaults double from it (1024, 2048, 4096, ...)."""

CHUNK_BUCKETS = (64, 128, 256)
"""Default prefill chunk sizes: a prompt's chunk is the smallest that holds it (capped by the
``chunk_size`` asked for), so short prompts compute little padding and few shapes compile."""


def default_max_len(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """The default capacity: the smallest of ``1024 * 2**k`` that holds the longest prompt plus
    ``max_new_tokens``.

    Attention costs what the live context costs (:mod:`dflash_jax.nn.attention`), so a
    roomy capacity is free at decode time; fixed buckets let one compiled program (and the
    persistent compilation cache) serve every prompt and budget within a bucket.
    """
    need = max(len(p) for p in prompts) + int(max_new_tokens)
    return MIN_CAPACITY * 2 ** max(0, math.ceil(math.log2(need / MIN_CAPACITY)))


def effective_chunk_size(chunk_size: int, max_prompt_len: int) -> int:
    """The prefill chunk: the smallest of :data:`CHUNK_BUCKETS` that holds the longest prompt
    (the largest when none does), capped at ``chunk_size``.

    A chunk larger than the prompt only computes padding; buckets keep short prompts cheap while
    few shapes compile. The result does not depend on the chunk size.
    """
    bucket = next((c for c in CHUNK_BUCKETS if c >= max_prompt_len), CHUNK_BUCKETS[-1])
    return max(1, min(int(chunk_size), bucket))


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_target(target) -> None:
    if not isinstance(target, Target):
        raise DFlashError("target", f"got {type(target).__name__}", "a Target from load_target")


def _prompt_ids(b: int, p, vocab_size: int) -> list[int]:
    """Row ``b`` of the prompts as a list of in-vocabulary ids."""
    if hasattr(p, "__array__") and not isinstance(p, (list, tuple)):
        arr = np.asarray(p)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise DFlashError("prompts", f"prompt {b} is a {arr.dtype} array of shape {arr.shape}", "a 1-D integer array or a list of token ids")
        p = arr.tolist()
    if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
        raise DFlashError("prompts", f"prompt {b} is {type(p).__name__}", "a list of token ids (see encode_prompt)")
    for i in p:
        if not _is_int(i):
            raise DFlashError("prompt", f"prompt {b} holds {i!r} ({type(i).__name__})", "integer token ids")
    ids = [int(i) for i in p]
    if not ids:
        raise DFlashError("prompt", f"prompt {b} is empty", "at least one token")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DFlashError("prompt", f"token id {bad[0]} outside the vocabulary", f"ids in [0, {vocab_size})")
    return ids


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """``prompts`` as ``list[list[int]]``: rows may be lists, tuples, numpy or JAX integer arrays
    (a 2-D integer array is a batch of equal-length rows)."""
    if hasattr(prompts, "__array__") and not isinstance(prompts, (list, tuple)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise DFlashError("prompts", f"array of shape {arr.shape}", "a [batch, length] integer array or a list of token-id lists")
        prompts = list(arr)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise DFlashError("prompts", "not a non-empty list of token-id lists", "[[id, ...], ...]")
    return [_prompt_ids(b, p, vocab_size) for b, p in enumerate(prompts)]


def _resolve_max_len(cfg, prompts: list[list[int]], max_new_tokens: int, max_len) -> int:
    """The capacity per row: ``max_len`` checked against the target's positions, or the default."""
    limit = int(cfg.max_position_embeddings)
    longest = max(len(p) for p in prompts)
    if max_len is None:
        if longest + max_new_tokens > limit:
            raise DFlashError("max_new_tokens (--max-new-tokens)", f"{max_new_tokens} after a prompt of {longest} tokens needs {longest + max_new_tokens} "
                              f"positions; the target has {limit} (max_position_embeddings)", f"at most {max(limit - longest, 0)}")
        return min(default_max_len(prompts, max_new_tokens), limit)
    if not _is_int(max_len) or max_len < 2:
        raise DFlashError("max_len (--max-len)", f"got {max_len!r}", "an integer >= 2")
    if max_len > limit:
        raise DFlashError("max_len (--max-len)", f"{max_len} exceeds the target's {limit} positions (max_position_embeddings)", f"an integer in [2, {limit}]")
    return int(max_len)


def str_list(value, name: str, option: str) -> list[str]:
    """``value`` as a list of strings; raises DFlashError naming ``name`` (one ``option`` each) otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(isinstance(x, str) for x in value):
        raise DFlashError(name, f"got {value!r}", f"a list of strings (one per {option})")
    return list(value)


def _stops(target: Target, stop_ids, stop, ignore_eos: bool) -> tuple[list[int], list[str]]:
    """``(stop ids, stop texts)``: EOS (unless ``ignore_eos``), ``stop_ids`` and the stop texts of
    one token; every stop text also cuts the text (see :mod:`dflash_jax`)."""
    stop = str_list(stop, "stop", "--stop")
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (Sequence, np.ndarray)) or not all(_is_int(i) for i in stop_ids):
        raise DFlashError("stop_ids", f"got {stop_ids!r}", "a list of integer token ids")
    stop_tok_ids, _ = split_stop(target.tokenizer, stop) if stop else ([], [])
    stops = [] if ignore_eos else list(target.eos_ids)
    for i in list(stop_ids) + stop_tok_ids:
        if int(i) not in stops:
            stops.append(int(i))
    return stops, stop


def _check_cost_model(cost_model, static: Decoding) -> None:
    """``cost_model`` is ``None``, ``"refresh"`` or a :class:`~dflash_jax.decode.auto.costs.CostModel` of the
    drafted depth, and only given under ``n_max="auto"``."""
    if cost_model is None:
        return
    if not static.adaptive:
        got = "given without a drafter" if static.drafter is None else f"given with n_max {static.n_max!r}"
        raise DFlashError("cost_model (--measure-costs)", got, "n_max='auto' with a drafter (plain decoding and fixed depths weigh no costs)")
    if isinstance(cost_model, CostModel):
        if cost_model.widths != static.auto_widths:
            what = f"a tree of {static.tree} nodes" if static.tree else f"{static.depth} drafted tokens"
            raise DFlashError("cost_model", f"prices the verify widths {cost_model.widths}", f"{static.auto_widths} ({what} under n_max='auto')")
    elif cost_model != "refresh":
        raise DFlashError("cost_model", f"got {cost_model!r}", "None (kept or measured), 'refresh' (measure again) or a CostModel")


def drafter_decoding(target_cfg, drafter: Drafter, draft_mode: str = "argmax", n_max=None, tree=None) -> Decoding:
    """The :class:`~dflash_jax.decode.state.Decoding` of a generation with ``drafter``: ``n_max=None``
    takes the drafter's recorded depth (``"auto"`` with its ``auto_depth`` for the shipped
    drafter); ``tree=None`` takes its recorded tree (:attr:`~dflash_jax.loading.Drafter.tree`)
    where its recorded depth applies and drafts are argmax (a tree holds the drafter's top
    candidates), else a chain; ``tree=0`` is a chain; ``tree=N`` a best-first tree of ``N`` nodes.

    Raises:
      DFlashError: a ``tree`` that is not a node count, or settings that do not go together
        (:class:`~dflash_jax.decode.state.Decoding`; the message names the argument and its option).
    """
    if tree is not None and (isinstance(tree, bool) or not _is_int(tree) or tree < 0):
        raise DFlashError("tree (--tree)", f"got {tree!r}", "an integer >= 0 (0: a chain of drafts) or None (the drafter's recorded tree)")
    depth = drafter.n_max if n_max is None else n_max
    if tree is None:
        tree = drafter.tree if n_max is None and draft_mode == "argmax" else None
    return Decoding(target_cfg, drafter.cfg, draft_mode, depth, drafter.auto_depth if depth == AUTO else None, int(tree) if tree else None)


def check_request(target, prompts, *, max_new_tokens, sampling, max_len, chunk_size, stop_ids, stop, ignore_eos, seed, on_tokens,
                  drafter, n_max, draft_mode, cost_model=None, tree=None, positional=()) -> Request:
    """Checks :func:`dflash_jax.generate`'s arguments (same names, keyword-only after ``prompts``;
    ``positional``: what a caller passed by position after ``prompts``, refused) and resolves the
    defaults.

    Raises:
      DFlashError: naming the first bad argument (and its option).
    """
    if positional:  # keyword-only: say so, and what to write instead
        raise DFlashError("generate", f"{len(positional)} positional argument(s) after prompts",
                          "keyword arguments, e.g. generate(target, prompts, max_new_tokens=64)")
    _check_target(target)
    prompts = _check_prompts(prompts, target.cfg.vocab_size)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise DFlashError("max_new_tokens (--max-new-tokens)", f"got {max_new_tokens!r}", "an integer >= 1")
    check_chunk_size(chunk_size)
    if not isinstance(sampling, SamplingConfig):
        raise DFlashError("sampling", f"got {type(sampling).__name__}", "a SamplingConfig, e.g. SamplingConfig(temperature=0.7)")
    if not _is_int(seed):  # the range is checked by decode.init_state (which also takes a PRNG key)
        raise DFlashError("seed (--seed)", f"got {seed!r}", "an integer in [0, 2**63)")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise DFlashError("drafter", f"got {type(drafter).__name__}", "a Drafter from load_drafter or shipped_drafter, or None")
    if on_tokens is not None and not callable(on_tokens):
        raise DFlashError("on_tokens", f"got {type(on_tokens).__name__}", "a callable or None")
    stops, stop_texts = _stops(target, stop_ids, stop, ignore_eos)
    max_len = _resolve_max_len(target.cfg, prompts, max_new_tokens, max_len)
    if drafter is None:
        if tree is not None:
            raise DFlashError("tree (--tree)", f"got {tree!r} without a drafter", "a drafter, or tree=None")
        static, params = Decoding(target.cfg, None, draft_mode, n_max), Params(target.state())
    else:
        static, params = drafter_decoding(target.cfg, drafter, draft_mode, n_max, tree), Params(target.state(), drafter.state())
    _check_cost_model(cost_model, static)
    calibration = None
    if static.adaptive:  # a policy of the right shapes for compiling; the driver sets its costs before prefill
        calibration = drafter.calibration or Calibration.identity(static.depth)
        widths = static.auto_widths
        params = params._replace(depth=depth_policy(calibration, CostModel.forcing(widths[-1], widths[-1], widths), depth=static.depth))
    # a budget beyond the capacity never applies; capping it keeps it within int32
    return Request(prompts=prompts, max_new_tokens=min(int(max_new_tokens), max_len), max_len=max_len,
                   chunk_size=effective_chunk_size(chunk_size, max(len(p) for p in prompts)), stop_ids=tuple(stops),
                   stop_texts=tuple(stop_texts), seed=int(seed), sampling=sampling, static=static, params=params, calibration=calibration,
                   cost_model=cost_model)
