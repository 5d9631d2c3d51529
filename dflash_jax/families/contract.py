"""The contract a target family's model fulfils: :class:`FamilyModel`.

Every caller outside a family's own modules (prefill, decode, verify, tree verification, the
drafters' embedding and head, training features, loading and sharding, the GPU tools) reaches a
target only through these functions, resolved from the static config by
:func:`dflash_jax.families.registry.module_for`. ``tests/test_families.py`` checks every registered family
against this contract (names and order of the parameters, and behaviour on a tiny config).

A family declares only what is its own: its parameters (``param_specs``, a tree of
:class:`~dflash_jax.nn.params.ParamSpec`), its decoder stack (``forward_hidden``), its cache when
it is not the plain :class:`~dflash_jax.runtime.carry.KVCache` of its dims (``init_cache`` and
``move_rows``), an embedding or head of its own, the recurrent-state hooks, and its capabilities
(:data:`CAPABILITIES`). What every family repeated (``param_shapes``, ``param_axes``,
``init_params``, the plain ``init_cache``/``move_rows``, ``forward`` = ``lm_head`` of
``forward_hidden``) is derived here. Each family's ``model.py`` builds its ``MODEL`` and the
registry holds it; nothing here imports a family.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable
from dflash_jax.errors import DFlashError
from dflash_jax.nn import layer as nn_layer
from dflash_jax.nn import params as P
from dflash_jax.runtime.carry import init_kv_cache


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
DERIVED = ("param_shapes", "param_axes", "init_params", "forward")
"""The functions :class:`FamilyModel` derives from what a family declares (never declared)."""
CAPABILITIES = ("paged_kv", "trees", "recurrent_state", "per_layer")
"""The declared capability flags of :class:`FamilyModel` (bools, read by name)."""


@dataclasses.dataclass(frozen=True)
class FamilyModel:
    """The model functions of one target family (``cfg``: the family's static config).

    Declared by the family (``MODEL = FamilyModel(...)`` in its ``model.py``):
      name: the family's name (``"dense"``, ...; named in errors) and module: its model module's
        ``__name__`` (the derived functions' ``__module__``, so compiled-executable keys and
        tracebacks name the family).
      param_specs: ``cfg -> tree of ParamSpec`` (:mod:`dflash_jax.nn.params`) shaped like the params.
      forward_hidden: ``(params, cfg, tokens, positions, cache, capture=None, tree=None) ->
        (hidden [B, T, H], cache, capture)`` (:func:`dflash_jax.families.dense.model.forward_hidden`).
      embed: ``(params, cfg, tokens [B, T] int32) -> [B, T, H]``: what the first decoder layer
        reads, with any family scaling (Gemma's ``sqrt(H)``) applied; the drafters embed their
        blocks through it. Default :func:`dflash_jax.nn.layer.embed`.
      lm_head: ``(params, cfg, hidden [..., H]) -> float32 logits [..., V]`` of final-normed
        hidden states, with any family soft-cap applied; the drafters' logits go through it. It
        reads only the head (``params["lm_head"] [H, V]``, its optional ``[V, H]`` copy
        ``lm_head_t``, or a tied ``embed``) and works column by column: given ``{"lm_head": [H, N]}``,
        N columns of the head, it returns those N columns of the logits (how a reduced draft
        vocabulary's head runs: :func:`dflash_jax.drafter.model.head_logits`). Default
        :func:`dflash_jax.nn.layer.lm_head`.
      init_cache: ``(cfg, batch, capacity) -> cache`` empty, ``capacity`` slots per row. Default
        (``None``): the plain :class:`~dflash_jax.runtime.carry.KVCache` of ``cfg``'s
        ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` and ``dtype``.
      move_rows: ``(cfg, cache, src [B, W], dst [B, W]) -> cache`` with K/V of slot ``src`` copied
        to ``dst`` (a verified tree's accepted path). Default (``None``): the plain cache's
        :meth:`~dflash_jax.runtime.carry.KVCache.moved` with ``trees``, a refusal without.
      keep_block_states: optional, ``(cfg, cache) -> cache`` marked so that the next
        ``forward_hidden`` (a verify pass) keeps each block position's recurrent state.
      commit_block_states: optional, ``(cfg, cache, kept [B] int32) -> cache`` with the recurrent
        states after the first ``kept[b]`` positions of the verified block (the committed ones).
        Both come with ``recurrent_state`` (:mod:`dflash_jax.families.qwen3_5.model`) or not at all.
      paged_kv: the family's forward also takes a :class:`~dflash_jax.runtime.carry.PagedKVCache` shaped
        like its :class:`~dflash_jax.runtime.carry.KVCache` (it writes through ``cache.written`` and
        attends with ``pages=cache.pages``): a serving batch may page it. Needs the plain cache.
      trees: it verifies draft trees (``forward_hidden(tree=...)`` and ``move_rows``).
      recurrent_state: its cache holds per-sequence recurrent state: a verify keeps and commits it
        through ``keep_block_states`` / ``commit_block_states``.
      per_layer: its decoder layers may be held per layer (:func:`dflash_jax.nn.params.unstack_layers`;
        ``param_axes(cfg, per_layer=True)``).

    Derived (:data:`DERIVED`, same object on every access):
      param_shapes: ``cfg -> tree of shape tuples``.
      param_axes: ``(cfg, per_layer=False) -> tree of logical axis tuples``; ``per_layer`` gives
        the tree of per-layer params (:func:`dflash_jax.nn.params.is_per_layer`); a family
        without ``per_layer`` raises :class:`DFlashError` for it.
      init_params: ``(cfg, key, scale=0.02) -> params`` random (:func:`dflash_jax.nn.params.init`), for tests.
      forward: ``(params, cfg, tokens, positions, cache, capture=None) -> (logits [B, T, V]
        float32, cache, capture)``: ``lm_head`` of ``forward_hidden``.

    Raises (on construction):
      DFlashError: a declared function of another signature, one recurrent-state hook without the
        other or not matching ``recurrent_state``, or ``paged_kv`` with a cache of the family's own.
    """

    name: str
    module: str
    param_specs: Callable[..., Any]
    forward_hidden: Callable[..., Any]
    embed: Callable[..., Any] = nn_layer.embed
    lm_head: Callable[..., Any] = nn_layer.lm_head
    init_cache: Callable[..., Any] | None = None
    move_rows: Callable[..., Any] | None = None
    keep_block_states: Callable[..., Any] | None = None
    commit_block_states: Callable[..., Any] | None = None
    paged_kv: bool = False
    trees: bool = True
    recurrent_state: bool = False
    per_layer: bool = False

    def __post_init__(self):
        where = f"{self.module}"
        hooks = [n for n in OPTIONAL if getattr(self, n) is not None]
        if len(hooks) not in (0, len(OPTIONAL)) or bool(hooks) != self.recurrent_state:
            raise DFlashError(where, f"recurrent_state={self.recurrent_state} with the hooks {hooks}",
                              f"recurrent_state=True with both of {OPTIONAL}, or neither")
        if self.paged_kv and self.init_cache is not None and not getattr(self.init_cache, "derived", False):
            raise DFlashError(where, "paged_kv=True with a cache of its own", "paged_kv only on the plain KVCache (init_cache=None)")
        for n in CAPABILITIES:
            if not isinstance(getattr(self, n), bool):
                raise DFlashError(f"{where}: {n}", f"got {getattr(self, n)!r}", "a bool")
        if self.init_cache is None:
            object.__setattr__(self, "init_cache", self._derived("init_cache", lambda cfg, batch, capacity: _plain_cache(cfg, batch, capacity)))
        if self.move_rows is None:
            moved = (lambda cfg, cache, src, dst: cache.moved(src, dst)) if self.trees else self._no_trees()
            object.__setattr__(self, "move_rows", self._derived("move_rows", moved))
        for n in SIGNATURES:
            if n not in DERIVED and getattr(self, n) is not None:
                check_signature(n, getattr(self, n), where)

    def _derived(self, name: str, fn: Callable) -> Callable:
        """``fn`` (a function of this instance's own) named ``module.name`` (what compiled-executable
        keys and tracebacks read)."""
        fn.__module__, fn.__name__, fn.__qualname__ = self.module, name, name
        fn.derived = True  # what dataclasses.replace passes back in is not a cache of the family's own
        return fn

    def _no_trees(self) -> Callable:
        name = self.name

        def move_rows(cfg, cache, src, dst):
            raise DFlashError("tree (--tree)", f"a draft tree with a {name} target", "a chain (tree=None)")

        return move_rows

    @functools.cached_property
    def param_shapes(self) -> Callable[..., Any]:
        specs = self.param_specs
        return self._derived("param_shapes", lambda cfg: P.shapes(specs(cfg)))

    @functools.cached_property
    def param_axes(self) -> Callable[..., Any]:
        specs, name, per_layer_ok = self.param_specs, self.name, self.per_layer

        def param_axes(cfg, per_layer: bool = False):
            if per_layer and not per_layer_ok:
                raise DFlashError(f"{name} param_axes(per_layer=True)", f"{name} targets keep their layers stacked or per key",
                                  "per_layer=False")
            return P.axes(specs(cfg), per_layer)

        return self._derived("param_axes", param_axes)

    @functools.cached_property
    def init_params(self) -> Callable[..., Any]:
        specs = self.param_specs
        return self._derived("init_params", lambda cfg, key, scale=0.02: P.init(specs(cfg), key, scale, cfg.dtype))

    @functools.cached_property
    def forward(self) -> Callable[..., Any]:
        forward_hidden, lm_head = self.forward_hidden, self.lm_head

        def forward(params, cfg, tokens, positions, cache, capture=None):
            hidden, cache, capture = forward_hidden(params, cfg, tokens, positions, cache, capture)
            return lm_head(params, cfg, hidden), cache, capture

        return self._derived("forward", forward)


def _plain_cache(cfg, batch, capacity):
    return init_kv_cache(cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype)


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
