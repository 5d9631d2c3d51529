"""Logical axes declared with each field of the decode carry.

Every array field of :class:`~dflash_jax.state.DecodeState`, of the caches and of the speculative
extension is declared with :func:`axes_field`, which records one logical axis name (or ``None``)
per dimension next to the field itself. :func:`declared_axes` reads them back as a tree shaped
like the state; :func:`dflash_jax.sharding.state_axes` (placement) and
:func:`dflash_jax.decode.replace_rows` (continuous batching: every ``"batch"`` axis is swapped)
both use it, so a new per-row field is sharded and swapped as soon as it is declared, and an
undeclared array field is an error rather than a silently skipped one.
"""

from __future__ import annotations

import dataclasses

import jax

from dflash_jax import pytree
from dflash_jax.errors import DFlashError

# Logical axis names of cache arrays (see dflash_jax.sharding).
KV_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


def axes_field(*axes: str | None, **kwargs):
    """A pytree dataclass field whose arrays have the logical axes ``axes`` (one per dimension).

    A field holding a container of arrays (a dict or tuple of them) gives every array in it the
    same axes. ``kwargs`` go to :func:`dflash_jax.pytree.field` (e.g. ``default``).
    """
    return pytree.field(metadata={"axes": tuple(axes)}, **kwargs)


def declared_axes(tree, where: str = "state"):
    """The logical axes of every array of a pytree dataclass, as a tree of the same structure
    (each array replaced by its tuple of names; ``None`` fields stay ``None``).

    Raises:
      DFlashError: an array field declared without :func:`axes_field`, or whose rank differs
        from its declared axes (the message names the field).
    """
    if tree is None:
        return None
    updates = {}
    for f in dataclasses.fields(tree):
        if not f.metadata.get("pytree_node", True):
            continue
        value, path = getattr(tree, f.name), f"{where}.{f.name}"
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            updates[f.name] = declared_axes(value, path)
            continue
        if "axes" not in f.metadata:
            raise DFlashError(path, "an array field without declared logical axes", "a field declared with dflash_jax.axes.axes_field(...)")
        updates[f.name] = jax.tree_util.tree_map(lambda x, ax=f.metadata["axes"], p=path: _checked(ax, x, p), value)
    return tree.replace(**updates)


def _checked(axes: tuple, leaf, path: str) -> tuple:
    if len(axes) != leaf.ndim:
        raise DFlashError(path, f"an array of rank {leaf.ndim} {tuple(leaf.shape)}", f"rank {len(axes)} as its declared axes {axes}")
    return axes


def flat_axes(tree) -> list[tuple]:
    """One axes tuple per array leaf of ``tree``, in ``jax.tree_util`` leaf order."""
    return jax.tree_util.tree_structure(tree).flatten_up_to(declared_axes(tree))
