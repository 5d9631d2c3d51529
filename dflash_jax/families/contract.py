"""The contract a target family's model fulfils: :class:`FamilyModel`.

Every caller outside a family's own modules (prefill, decode, verify, tree verification, the
drafters' embedding and head, training features, loading and sharding, the GPU tools) reaches a
target only through these functions, resolved from the static config by
:func:`dflash_jax.families.registry.module_for`. ``tests/test_families.py`` checks every registered family
against this contract (names and order of the parameters, and behaviour on a tiny config).

Nothing here imports a model: a family's module builds its :class:`FamilyModel` with
:meth:`FamilyModel.of_module`, and the registry holds it.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any, Callable
from dflash_jax.errors import DFlashError


# the leading parameters every family's function takes, in order (keyword defaults may follow)
SIGNATURES: dict[str, tuple[str, ...]] = {
    "param_specs": ("cfg",),
    "param_shapes": ("cfg",),
    "param_axes": ("cfg", "per_layer"),
    "init_params": ("cfg", "key", "scale"),
    "init_cache": ("cfg", "batch", "capacity"),
    "embed": ("params", "cfg", "tokens"),
    "lm_head": ("params", "cfg", "hidden"),
    "forward_hidden": ("params", "cfg", "tokens", "positions", "cache", "capture", "tree"),
    "forward": ("params", "cfg", "tokens", "positions", "cache", "capture"),
    "move_rows": ("cfg", "cache", "src", "dst"),
    "keep_block_states": ("cfg", "cache"),
    "commit_block_states": ("cfg", "cache", "kept"),
}
OPTIONAL = ("keep_block_states", "commit_block_states")
"""Hooks only a family with recurrent state has (``None`` elsewhere: rollback is the length update)."""


@dataclasses.dataclass(frozen=True)
class FamilyModel:
    """The model functions of one target family (``cfg``: the family's static config).

    Attributes:
      param_specs: ``cfg -> tree of ParamSpec`` (:mod:`dflash_jax.nn.params`) shaped like the params.
      param_shapes: ``cfg -> tree of shape tuples``.
      param_axes: ``(cfg, per_layer=False) -> tree of logical axis tuples``; ``per_layer`` gives
        the tree of per-layer params (:func:`dflash_jax.nn.params.is_per_layer`); a family
        whose layers stay stacked raises :class:`DFlashError` for it.
      init_params: ``(cfg, key, scale=0.02) -> params`` random, for tests.
      init_cache: ``(cfg, batch, capacity) -> cache`` empty, ``capacity`` slots per row.
      embed: ``(params, cfg, tokens [B, T] int32) -> [B, T, H]``: what the first decoder layer
        reads, with any family scaling (Gemma's ``sqrt(H)``) applied; the drafters embed their
        blocks through it.
      lm_head: ``(params, cfg, hidden [..., H]) -> float32 logits [..., V]`` of final-normed
        hidden states, with any family soft-cap applied; the drafters' logits go through it. It
        reads only the head (``params["lm_head"] [H, V]``, its optional ``[V, H]`` copy
        ``lm_head_t``, or a tied ``embed``) and works column by column: given ``{"lm_head": [H, N]}``,
        N columns of the head, it returns those N columns of the logits (how a reduced draft
        vocabulary's head runs: :func:`dflash_jax.drafter.model.head_logits`).
      forward_hidden: ``(params, cfg, tokens, positions, cache, capture=None, tree=None) ->
        (hidden [B, T, H], cache, capture)`` (:func:`dflash_jax.families.dense.model.forward_hidden`).
      forward: ``(params, cfg, tokens, positions, cache, capture=None) -> (logits, cache, capture)``.
      move_rows: ``(cfg, cache, src [B, W], dst [B, W]) -> cache`` with K/V of slot ``src`` copied
        to ``dst`` (a verified tree's accepted path).
      keep_block_states: optional, ``(cfg, cache) -> cache`` marked so that the next
        ``forward_hidden`` (a verify pass) keeps each block position's recurrent state.
      commit_block_states: optional, ``(cfg, cache, kept [B] int32) -> cache`` with the recurrent
        states after the first ``kept[b]`` positions of the verified block (the committed ones).
        Both come together (:mod:`dflash_jax.families.qwen3_5.model`) or not at all.
      paged_kv: the family's forward also takes a :class:`~dflash_jax.runtime.carry.PagedKVCache` shaped
        like its :class:`~dflash_jax.runtime.carry.KVCache` (it writes through ``cache.written`` and
        attends with ``pages=cache.pages``): a serving batch may page it (module flag ``PAGED_KV``).
    """

    param_specs: Callable[..., Any]
    param_shapes: Callable[..., Any]
    param_axes: Callable[..., Any]
    init_params: Callable[..., Any]
    init_cache: Callable[..., Any]
    embed: Callable[..., Any]
    lm_head: Callable[..., Any]
    forward_hidden: Callable[..., Any]
    forward: Callable[..., Any]
    move_rows: Callable[..., Any]
    keep_block_states: Callable[..., Any] | None = None
    commit_block_states: Callable[..., Any] | None = None
    paged_kv: bool = False

    @classmethod
    def of_module(cls, module: ModuleType) -> "FamilyModel":
        """The contract's functions taken from ``module`` by name, each checked by
        :func:`check_signature`.

        Raises:
          DFlashError: a function missing from ``module`` or of another signature.
        """
        fns = {"paged_kv": bool(getattr(module, "PAGED_KV", False))}
        for f in dataclasses.fields(cls):
            if f.name == "paged_kv":
                continue
            fn = getattr(module, f.name, None)
            if fn is None and f.name in OPTIONAL:
                continue
            if not callable(fn):
                raise DFlashError(f"{module.__name__}.{f.name}", "missing", "a function of the family contract")
            check_signature(f.name, fn, module.__name__)
            fns[f.name] = fn
        if sum(name in fns for name in OPTIONAL) == 1:
            raise DFlashError(f"{module.__name__}", f"only {next(n for n in OPTIONAL if n in fns)} of the recurrent-state hooks",
                              f"both of {OPTIONAL} or neither")
        return cls(**fns)


def check_signature(name: str, fn: Callable, where: str = "family") -> None:
    """Checks that ``fn``'s leading parameters are :data:`SIGNATURES` ``[name]`` in order, and
    that any further ones have defaults.

    Raises:
      DFlashError: another parameter list (names ``where.name``, what it got and what it needs).
    """
    params = list(inspect.signature(fn).parameters.values())
    want = SIGNATURES[name]
    got = tuple(p.name for p in params[: len(want)])
    rest = [p.name for p in params[len(want):] if p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if got != want or rest:
        raise DFlashError(f"{where}.{name}", f"parameters {tuple(p.name for p in params)}",
                          f"leading parameters {want}, any others with defaults")
