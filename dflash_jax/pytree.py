"""Frozen dataclasses registered as JAX pytrees: the containers of the decode carry.

:func:`dataclass` is ``dataclasses.dataclass(frozen=True)`` registered with
:func:`jax.tree_util.register_dataclass`: fields are pytree children (arrays, traced) unless
declared ``field(pytree_node=False)``, which makes them static metadata (hashable: part of a
jitted function's cache key). Instances get ``replace(**changes)``. It is the subset of
``flax.struct`` this package used, on JAX's own API: importing flax took 0.35 s of every
command's start (BENCHMARKS.md, "Time to first token").
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["dataclass", "field"]


def field(pytree_node: bool = True, **kwargs):
    """A dataclass field; ``pytree_node=False`` makes it static. ``kwargs`` go to
    :func:`dataclasses.field` (``default``, ``metadata``, ...); the flag is kept in the metadata
    as ``"pytree_node"`` (what :func:`dflash_jax.axes.declared_axes` reads)."""
    metadata = dict(kwargs.pop("metadata", None) or {}, pytree_node=pytree_node)
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self, **changes):
    return dataclasses.replace(self, **changes)


def dataclass(cls):
    """``cls`` as a frozen dataclass and a JAX pytree (module docstring)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if f.metadata.get("pytree_node", True)]
    meta = [f.name for f in fields if not f.metadata.get("pytree_node", True)]
    cls.replace = _replace
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
