"""Training over a device mesh, in one process or several (``dflash-jax train --mesh data=D,model=M``).

Layout (the rules of :mod:`dflash_jax.runtime.sharding`, :data:`~dflash_jax.runtime.sharding.DEFAULT_RULES`):

* the batch: rows over ``data``, the rest replicated. Each process builds only the rows its own
  devices hold, from the same deterministic :class:`~dflash_jax.train.data.Batcher` order (batch
  ``i`` is a pure function of ``(seed, i)``), and the global batch is assembled from the
  processes' rows (``jax.make_array_from_callback``); no process reads another's rows;
* the drafter's float32 parameters (the module's ``nnx.State``) by the logical axes each
  ``nnx.Param`` holds as its ``out_sharding`` metadata (heads, MLP width and vocabulary over
  ``model``; replicated over ``data``), the AdamW moments like the parameters they follow, the
  optimizer's counters, the PRNG key and the step replicated;
* the frozen target by its own logical axes.

The step is :func:`dflash_jax.train.step.apply_step` jitted with these shardings in and out (the
state donated), so every step keeps the same layout and compiles once. Its result is the
one-device step's up to the order of float additions: the loss and the gradients reduce over rows
on different devices (``tests/test_train_mesh.py`` measures how close, float32).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.families import registry
from dflash_jax.runtime import sharding
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.nn.params import is_per_layer
from dflash_jax.train.optim import TrainConfig, make_optimizer
from dflash_jax.train.step import TrainState, apply_step

__all__ = ["MeshStep", "check_batch_size", "param_shardings", "place_state", "place_target", "rows_of_process", "state_shardings"]


def check_batch_size(mesh: Mesh, batch_size: int) -> None:
    """Raises DFlashError naming ``--batch-size`` and ``--mesh`` when the mesh's ``data`` axis
    does not divide ``batch_size`` (every data slice holds the same number of rows)."""
    d = int(mesh.shape.get("data", 1))
    if int(batch_size) % d:
        raise DFlashError("--batch-size", f"{batch_size} rows do not split evenly over the data axis of --mesh ({d} ways)",
                          f"a multiple of {d}, or another data size in --mesh")


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """The :class:`NamedSharding` of every param of a drafter module's ``params`` (its
    ``nnx.State``), shaped like it (each ``nnx.Param``'s value its sharding): the logical axes of
    the param's ``out_sharding`` metadata mapped by
    :data:`~dflash_jax.runtime.sharding.DEFAULT_RULES` (a mesh axis that does not divide a
    dimension leaves it replicated; a param without axes is replicated).

    Raises:
      DFlashError: a param whose axes name another number of dimensions than it has (names it).
    """
    def axes(v: nnx.Variable):
        names = v.get_metadata().get("out_sharding")
        return v.replace(tuple(names) if names is not None else (None,) * np.ndim(v.get_value()))

    return sharding.tree_shardings(params, jax.tree_util.tree_map(axes, params, is_leaf=lambda x: isinstance(x, nnx.Variable)), mesh)


def state_shardings(state: TrainState, tc: TrainConfig, mesh: Mesh) -> TrainState:
    """The :class:`NamedSharding` of every array of ``state`` (a :class:`TrainState` of shardings):
    parameters by the axes their state holds (:func:`param_shardings`), every parameter-shaped
    tree of the optimizer state (the AdamW moments) like the parameters, the rest replicated."""
    params = param_shardings(state.params, mesh)
    rep = _replicated(mesh)
    opt = optax.tree_utils.tree_map_params(make_optimizer(tc), lambda _, sh: sh, state.opt_state, params,
                                           transform_non_params=lambda _: rep)
    return TrainState(params=params, opt_state=opt, rng=rep, step=rep)


def place_state(state: TrainState, shardings: TrainState) -> TrainState:
    """``state`` (the same values on every process) laid out with ``shardings``
    (:func:`state_shardings`)."""
    return sharding.place(state, shardings)


def place_target(target_params, target_cfg: TargetConfig, mesh: Mesh):
    """The frozen target's parameters laid out on ``mesh`` by its logical axes (stacked or
    per-layer decoder layers, the copies a loaded target holds following their weights)."""
    module = registry.module_for(target_cfg)
    per_layer = is_per_layer(target_params.get("layers"))
    axes = module.param_axes(target_cfg, per_layer=True) if per_layer else module.param_axes(target_cfg)
    return sharding.shard_params(target_params, axes, mesh)


def rows_of_process(mesh: Mesh, batch_size: int) -> tuple[int, int]:
    """``(lo, hi)``: the span of the rows of a ``batch_size``-row batch that this process's
    devices hold (rows over ``data``; contiguous for :func:`dflash_jax.runtime.sharding.make_mesh`, whose
    processes own consecutive devices); ``(0, batch_size)`` with one process."""
    sh = NamedSharding(mesh, PartitionSpec("data"))
    spans = [idx[0].indices(batch_size)[:2] for idx in sh.addressable_devices_indices_map((batch_size,)).values()]
    return min(a for a, _ in spans), max(b for _, b in spans)


class MeshStep:
    """The training step on ``mesh``: call it with the state (laid out by :func:`place_state`),
    the target (:func:`place_target`), batch ``i`` and the draft vocabulary.

    Args:
      mesh: the device mesh (every process's devices).
      shardings: the state's shardings (:func:`state_shardings`).
      cfg, target_cfg, tc: static settings of :func:`dflash_jax.train.step.apply_step`.
      draft_ids: ``[Vd]`` int32 or ``None`` (replicated on the mesh).
    """

    def __init__(self, mesh: Mesh, shardings: TrainState, cfg: DrafterConfig, target_cfg: TargetConfig, tc: TrainConfig,
                 draft_ids=None):
        self.mesh, self.shardings, self.batch_size = mesh, shardings, tc.batch_size
        self.rows = rows_of_process(mesh, tc.batch_size)
        self.draft_ids = None if draft_ids is None else sharding.place(np.asarray(draft_ids), _replicated(mesh))
        self._fn = functools.partial(apply_step, cfg=cfg, target_cfg=target_cfg, tc=tc)
        self._jitted = None

    def batch(self, batcher, step: int) -> dict:
        """Batch ``step`` as global arrays, rows over ``data``; this process reads only its rows
        (:meth:`dflash_jax.train.data.Batcher.batch` with ``rows``). ``lengths`` is left out."""
        lo, hi = self.rows
        local = batcher.batch(step, rows=(lo, hi))
        local.pop("lengths")
        out = {}
        for k, v in local.items():
            sh = NamedSharding(self.mesh, PartitionSpec("data", *([None] * (v.ndim - 1))))

            def part(idx, v=v):
                a, b = idx[0].indices(self.batch_size)[:2]
                return v[(slice(a - lo, b - lo),) + tuple(idx[1:])]

            out[k] = jax.make_array_from_callback((self.batch_size,) + v.shape[1:], sh, part)
        return out

    def __call__(self, state: TrainState, target_params, batch: dict):
        """``(state, metrics)`` of one step (``state`` donated; metrics replicated float32 scalars)."""
        if self._jitted is None:
            batch_sh = jax.tree_util.tree_map(lambda x: x.sharding, batch)
            target_sh = jax.tree_util.tree_map(lambda x: x.sharding, target_params)
            rep = _replicated(self.mesh)
            if self.draft_ids is None:
                fn, ins = (lambda s, t, b: self._fn(s, t, b)), (self.shardings, target_sh, batch_sh)
            else:
                fn, ins = (lambda s, t, b, ids: self._fn(s, t, b, draft_ids=ids)), (self.shardings, target_sh, batch_sh, rep)
            self._jitted = jax.jit(fn, in_shardings=ins, out_shardings=(self.shardings, rep), donate_argnums=(0,))
        args = (state, target_params, batch) if self.draft_ids is None else (state, target_params, batch, self.draft_ids)
        return self._jitted(*args)
