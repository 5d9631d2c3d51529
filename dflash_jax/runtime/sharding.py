"""Logical-axis sharding: map the models' logical axis names onto a device mesh.

Every parameter leaf has a tuple of logical axis names (``param_axes(cfg)`` of each model module:
``"layers"``, ``"embed"``, ``"vocab"``, ``"q_heads"``, ``"kv_heads"``, ``"head_dim"``, ``"mlp"``,
``"features"``, ``"experts"``, ...) and every decode-state array declares its own (:mod:`dflash_jax.runtime.carry`).
:class:`ShardingRules` maps each logical name to a mesh axis (or to nothing: replicated), and
:func:`logical_to_spec` turns one leaf's names into a :class:`jax.sharding.PartitionSpec`. The
models themselves never mention devices: jit propagates the shardings of its inputs.

Mesh axes (:func:`make_mesh`): ``"data"`` (batch rows), ``"model"`` (tensor parallel: heads, MLP
width, vocabulary), ``"expert"`` (expert parallel). On several hosts, build the mesh over
``jax.devices()`` (all processes) the same way on every host.

Uneven sizes: a mesh axis that does not divide the dimension it would split is dropped from that
dimension (the dimension is replicated over it) unless ``strict=True``, which raises instead. A mesh
axis is used at most once per spec: the first logical axis (left to right) that claims it gets it,
later ones are replicated over it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any, Sequence
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from dflash_jax.runtime.carry import declared_axes, flat_axes
from dflash_jax.errors import DFlashError
from dflash_jax.nn import params as layouts
from dflash_jax.nn import quant


MESH_AXES = ("data", "model", "expert")

MeshAxes = str | tuple[str, ...] | None


class ShardingRules(Mapping):
    """A frozen, hashable mapping ``logical axis name -> mesh axis name | tuple of names | None``.

    Names not in the mapping are replicated (``rules.get(name)`` is ``None``). Build a variant with
    :meth:`replace`, e.g. ``DEFAULT_RULES.replace(seq="data", batch=None)`` or
    ``DEFAULT_RULES.replace(batch=("data", "expert"))``.
    """

    __slots__ = ("_items",)

    def __init__(self, rules: Mapping[str, MeshAxes] | None = None, **kw: MeshAxes):
        d = dict(rules or {})
        d.update(kw)
        for k, v in d.items():
            if not (v is None or isinstance(v, str) or (isinstance(v, tuple) and all(isinstance(a, str) for a in v))):
                raise DFlashError(f"sharding rule {k!r}", f"got {v!r}", "a mesh axis name, a tuple of names or None")
        object.__setattr__(self, "_items", tuple(sorted(d.items())))

    def __setattr__(self, name, value):
        raise AttributeError("ShardingRules is frozen; use .replace(...)")

    def __getitem__(self, key: str) -> MeshAxes:
        return dict(self._items)[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardingRules) and self._items == other._items

    def __repr__(self) -> str:
        return f"ShardingRules({dict(self._items)!r})"

    def replace(self, **kw: MeshAxes) -> "ShardingRules":
        """A copy with the given logical names remapped (``None`` replicates)."""
        return ShardingRules(dict(self._items), **kw)

    def mesh_axes(self, name: str | None) -> tuple[str, ...]:
        """The mesh axes (possibly none) the logical axis ``name`` is split over."""
        v = self.get(name) if name is not None else None
        if v is None:
            return ()
        return (v,) if isinstance(v, str) else tuple(v)


DEFAULT_RULES = ShardingRules(
    batch="data",
    q_heads="model",
    kv_heads="model",
    mlp="model",
    vocab="model",
    experts="expert",
    expert_mlp="model",
)
"""Data parallel over rows, tensor parallel over heads / MLP width / vocabulary (and each expert's
MLP width), expert parallel over experts; ``layers``, ``embed``, ``seq``, ``head_dim``,
``features``, ``gate``, ``captures`` are replicated."""


def parse_mesh(spec) -> Mesh:
    """The mesh of ``spec``: a :class:`~jax.sharding.Mesh` (returned as it is) or a text
    ``"data=D,model=M,expert=E"`` (any of the three, each once; the others 1) over
    ``jax.devices()`` (:func:`make_mesh`).

    Raises:
      DFlashError: naming ``mesh (--mesh)``: another type, an unknown axis, a size that is not an
        integer >= 1, or more devices than there are.
    """
    if isinstance(spec, Mesh):
        return spec
    where, how = "mesh (--mesh)", f"axis=size pairs over {', '.join(MESH_AXES)}, e.g. data=2,model=2"
    if not isinstance(spec, str) or not spec.strip():
        raise DFlashError(where, f"got {spec!r}", how)
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or name in sizes or not size.strip().isdigit() or int(size) < 1:
            raise DFlashError(where, f"got {spec!r} ({part.strip()!r})", how + " (each axis once, sizes >= 1)")
        sizes[name] = int(size)
    try:
        return make_mesh(**sizes)
    except DFlashError as e:
        raise DFlashError(where, e.what, e.expected) from None


def describe(mesh: Mesh) -> str:
    """``"data=2, model=2 over 4 cpu devices"``: the mesh's axes larger than 1 and its devices."""
    axes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device"
    return f"{axes} over {mesh.size} {mesh.devices.flat[0].platform} devices"


def make_mesh(data: int = 1, model: int = 1, expert: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``(data, model, expert)`` :class:`jax.sharding.Mesh` over ``devices`` (default ``jax.devices()``).

    The first ``data * model * expert`` devices are used, in order (``model`` and ``expert``
    neighbours are adjacent devices).

    Raises:
      DFlashError: a size below 1, or more devices asked for than available.
    """
    sizes = (int(data), int(model), int(expert))
    if min(sizes) < 1:
        raise DFlashError("mesh", f"sizes data={data}, model={model}, expert={expert}", "every size >= 1")
    devices = list(jax.devices() if devices is None else devices)
    n = int(np.prod(sizes))
    if n > len(devices):
        raise DFlashError("mesh", f"data*model*expert = {n} devices asked for, {len(devices)} available", f"at most {len(devices)}")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(sizes), MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None],
    rules: ShardingRules = DEFAULT_RULES,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
    strict: bool = False,
) -> PartitionSpec:
    """The :class:`PartitionSpec` of one array whose dimensions have logical names ``axes``.

    Args:
      axes: one logical name (or ``None``) per dimension.
      rules: logical -> mesh axis mapping.
      mesh: when given, mesh axes it does not have, or of size 1, are left out.
      shape: when given (with ``mesh``), a mesh axis whose size does not divide its dimension is
        left out (that dimension is replicated over it), or an error with ``strict``.
      strict: raise on a non-dividing mesh axis instead of dropping it.
    Returns:
      A spec of ``len(axes)`` entries: ``None``, a mesh axis name or a tuple of names. No mesh axis
      appears twice: the leftmost logical axis that claims it keeps it.
    Raises:
      DFlashError: ``shape`` of another rank than ``axes``; with ``strict``, a non-dividing axis.
    """
    axes = tuple(axes)
    if shape is not None and len(shape) != len(axes):
        raise DFlashError("sharding", f"shape {tuple(shape)} has rank {len(shape)} but logical axes {axes} name {len(axes)}", "equal ranks")
    sizes = dict(mesh.shape) if mesh is not None else None
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        keep = []
        dim = None if shape is None else int(shape[i])
        split = 1
        for ax in rules.mesh_axes(name):
            if ax in used:
                continue
            if sizes is not None:
                if sizes.get(ax, 1) == 1:
                    continue
                if dim is not None and dim % (split * sizes[ax]):
                    if strict:
                        prior = f" times the {split}-way split before it" if split > 1 else ""
                        raise DFlashError(
                            "sharding", f"dimension {i} ({name!r}) of shape {tuple(shape)} is {dim}, not divisible by mesh axis "
                            f"{ax!r} of size {sizes[ax]}{prior}", f"a multiple of {split * sizes[ax]}, or strict=False to replicate it",
                        )
                    continue
                split *= sizes[ax]
            keep.append(ax)
            used.add(ax)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(tree, axes, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, strict: bool = False):
    """:class:`NamedSharding` for every array of ``tree`` from the parallel tree of logical ``axes``.

    Raises:
      DFlashError: ``axes`` not shaped like ``tree``, a leaf whose rank differs from its axes,
        or (``strict``) a non-dividing mesh axis.
    """
    ax_leaves, ax_def = jax.tree_util.tree_flatten(axes, is_leaf=_is_axes)
    tdef = jax.tree_util.tree_structure(tree)
    if ax_def.num_leaves != tdef.num_leaves or jax.tree_util.tree_structure(ax_def.unflatten([0] * len(ax_leaves))) != tdef:
        raise DFlashError("sharding", f"logical axes tree {ax_def} does not match the array tree {tdef}",
                          "param_axes(cfg) of the same config (param_axes(cfg, per_layer=True) for per-layer parameters)")
    return _named_shardings(tree, ax_leaves, mesh, rules, strict, "sharding ")


def _named_shardings(tree, ax_leaves, mesh: Mesh, rules: ShardingRules, strict: bool, where: str):
    """The :class:`NamedSharding` tree of ``tree`` from one axes tuple per leaf (errors name
    ``where`` + the leaf's path)."""
    flat, tdef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for (path, leaf), ax in zip(flat, ax_leaves):
        try:
            spec = logical_to_spec(ax, rules, mesh, np.shape(leaf), strict)
        except DFlashError as e:
            raise DFlashError(f"{where}{jax.tree_util.keystr(path)}", e.what, e.expected) from None
        out.append(NamedSharding(mesh, spec))
    return jax.tree_util.tree_unflatten(tdef, out)


def quantized_axes(axes, params):
    """``axes`` with the logical axes of every field of each quantized leaf of ``params``.

    A :class:`~dflash_jax.nn.quant.QuantizedWeight` standing for a float weight of logical axes
    ``(*lead, in, out)`` holds fields ``[*lead, out, k]``: they get ``(*lead, out, None)`` (the
    ``k`` values of a row stay together). The rows are the output axis, the last of a matmul
    weight's ``[in, out]``; a gathered table (``embed [V, H]``: axes ``("vocab", ...)``) is stored
    as ``V`` rows, so there the ``"vocab"`` axis is the rows'. Trees that do not match are
    returned as they are (:func:`tree_shardings` names the mismatch)."""
    def one(ax, leaf):
        if not quant.is_quantized(leaf) or not _is_axes(ax) or len(ax) < 2:
            return ax
        rows = ax[-2] if ax[-2] == "vocab" else ax[-1]
        return leaf.replace(fields={k: tuple(ax[:-2]) + (rows, None) for k in leaf.fields})

    try:
        return jax.tree_util.tree_map(one, axes, params, is_leaf=_is_axes)
    except (ValueError, TypeError):
        return axes


def param_shardings(params, axes, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, strict: bool = False):
    """The :class:`NamedSharding` tree of ``params`` (e.g. for ``jax.jit(out_shardings=...)`` when loading);
    ``axes`` need not name the copies a loaded target holds, a tied head's ``lm_head`` and the
    ``[out, in]`` copies of :mod:`dflash_jax.nn.params` (they follow their weights), nor the fields
    of quantized weights (:func:`quantized_axes`)."""
    return tree_shardings(params, quantized_axes(layouts.with_wide_axes(axes, params), params), mesh, rules, strict)


def shard_params(params, axes, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, strict: bool = False):
    """``params`` placed on ``mesh`` (``jax.device_put`` with :func:`param_shardings`).

    Args:
      params: a parameter pytree of any model module.
      axes: the same module's ``param_axes(cfg)`` (tuples of logical names, one per dimension).
      mesh, rules, strict: see :func:`logical_to_spec`.
    Raises:
      DFlashError: as :func:`tree_shardings`.
    """
    return _put(params, param_shardings(params, axes, mesh, rules, strict))


# --------------------------------------------------------------------------------------------
# Decode state

def state_axes(state) -> Any:
    """Logical axes of every array of a :class:`~dflash_jax.decode.state.DecodeState` (same tree).

    Read from the axes each field declares (:func:`dflash_jax.runtime.carry.axes_field`): ``tokens``/``gaps``
    ``[B, S]`` -> ``("batch", "seq")``; per-row vectors ``[B]`` -> ``("batch",)``; target cache
    ``k``/``v`` ``[L, B, S, Hkv, D]`` (Laguna: every ``kv`` pair, ring layers too) and drafter context
    ``ctx_k``/``ctx_v`` ``[Ld, B, S, Hkv, D]`` -> :data:`~dflash_jax.runtime.carry.KV_AXES`;
    ``accepted_per_position`` ``[B, n]``, ``stop_ids`` ``[B, n]`` and Laguna ``ring_pos`` ``[B, R]`` ->
    ``("batch", None)``; ``rng`` ``[B]`` (row keys) and the ``sampling`` settings ``[B]`` ->
    ``("batch",)``; ``steps`` is replicated.

    Raises:
      DFlashError: an array field without declared axes (names it).
    """
    return declared_axes(state)


def state_shardings(state, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, strict: bool = False):
    """:class:`NamedSharding` of every array of a decode state (see :func:`state_axes`).

    With the default rules, rows split over ``"data"`` and cache/context heads over ``"model"``
    (``B`` and ``Hkv`` that the axis sizes do not divide are replicated, or raise with ``strict``).

    Raises:
      DFlashError: with ``strict``, a non-dividing mesh axis.
    """
    return _named_shardings(state, flat_axes(state), mesh, rules, strict, "sharding state")


def shard_state(state, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, strict: bool = False):
    """``state`` placed on ``mesh`` (``jax.device_put`` with :func:`state_shardings`)."""
    return _put(state, state_shardings(state, mesh, rules, strict))


def place(tree, shardings):
    """``tree`` (arrays or numpy arrays, the same values on every process) laid out with
    ``shardings`` (a tree of :class:`NamedSharding` shaped like it); see :func:`_put`."""
    return _put(tree, shardings)


def _put(tree, shardings):
    """``jax.device_put(tree, shardings)``; across processes (:mod:`dflash_jax.runtime.distributed`)
    through the host, where each process holds the same values: an array on this process's
    devices cannot move to devices of another, and a PRNG key array goes as its key data."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sh):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            spec = PartitionSpec(*sh.spec, *([None] * (data.ndim - len(sh.spec))))
            wrap = functools.partial(jax.random.wrap_key_data, impl=jax.random.key_impl(x))
            return jax.jit(wrap, out_shardings=sh)(jax.device_put(data, NamedSharding(sh.mesh, spec)))
        return jax.device_put(np.asarray(x), sh)

    return jax.tree_util.tree_map(one, tree, shardings)
