"""The training state and the jitted training step: anchors sampled, target features taken from
the batch (or recomputed by the frozen target), the DFlash loss, one AdamW update.

The drafter being trained is a :class:`~dflash_jax.drafter.module.DrafterModule` (float32, layers
stacked); the step runs over its split state (:attr:`TrainState.params`, ``nnx.state(module,
nnx.Param)``): the loss reads it as the parameter tree at trace time
(:func:`dflash_jax.nn.module.tree_of`, as the decode steps read ``Params``), and the gradients and
the optax update are ``nnx.State`` pytrees of the same shape. The module's graph holds no
computation and follows from ``cfg`` (the step's static argument), so it is kept nowhere:
:func:`drafter_module` rebuilds the module over a state's arrays, and
:func:`~dflash_jax.nn.module.set_weights` loads the weights into a loaded drafter's module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dflash_jax.runtime import carry as pytree
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.drafter import model as drafter
from dflash_jax.drafter.module import DrafterModule
from dflash_jax.nn.module import tree_of
from dflash_jax.nn.params import stack_layers
from dflash_jax.train import objective
from dflash_jax.train.features import target_features, tree_fingerprint
from dflash_jax.train.optim import TrainConfig, lr_schedule, make_optimizer
from dflash_jax.errors import DFlashError

_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


@pytree.dataclass
class TrainState:
    """Everything a step changes: ``params``, the drafter module's ``nnx.State`` (one float32
    ``nnx.Param`` per leaf of :func:`dflash_jax.drafter.model.param_specs`' tree, layers stacked
    ``[L, ...]``, each param's logical axes as its ``out_sharding`` metadata;
    :func:`dflash_jax.nn.module.tree_of` reads it as that tree, the same arrays), optax
    ``opt_state`` (the AdamW moments as states shaped like ``params``), the PRNG ``rng`` (split
    once per step) and ``step`` (int32 scalar, the next step's index)."""

    params: nnx.State
    opt_state: object
    rng: jax.Array
    step: jnp.ndarray


def drafter_module(cfg: DrafterConfig, params) -> DrafterModule:
    """The float32 drafter module (the class of ``cfg.architecture``) over ``params``
    (:attr:`TrainState.params`, or a parameter tree): its params hold the same arrays, with
    ``cfg``'s logical axes as their ``out_sharding``. Raises DFlashError for an architecture
    without a module class."""
    cfg32 = cfg.with_dtype("float32")
    return DrafterModule.of(cfg32, tree_of(params), drafter.param_axes(cfg32))


def init_train_state(cfg: DrafterConfig, tc: TrainConfig, init_params=None) -> TrainState:
    """The float32 drafter module's state and a fresh optimizer state: random weights
    (:func:`dflash_jax.drafter.model.init_params`, from ``tc.seed``), or ``init_params`` (a
    drafter's weights to continue from: a parameter tree, a drafter module or its ``nnx.State``;
    cast to float32 and copied, stacked when given per layer as ``load_drafter`` keeps them on
    CPU; the run's PRNG still comes from ``tc.seed``).

    Raises:
      DFlashError: ``init_params`` whose names or shapes differ from ``cfg``'s drafter.
    """
    k_init, k_run = jax.random.split(jax.random.key(tc.seed))
    init = functools.partial(drafter.init_params, cfg.with_dtype("float32"), scale=tc.init_scale)
    if init_params is None:
        tree = init(k_init)
    else:
        init_params = stack_layers(tree_of(init_params))
        want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(jax.eval_shape(init, k_init))}
        got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(init_params)}
        if want != got:
            bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            raise DFlashError("initial drafter weights", f"{bad[0]} is {got.get(bad[0])}", f"{want.get(bad[0])} (the drafter being trained)")
        tree = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32, copy=True), init_params)  # steps donate
    params = nnx.state(drafter_module(cfg, tree), nnx.Param)
    return TrainState(params=params, opt_state=make_optimizer(tc).init(params), rng=k_run, step=jnp.zeros((), jnp.int32))


def params_fingerprint(params) -> str:
    """sha256 (hex, 16 chars) of a drafter's parameter tree's names, shapes and all its float32
    values (:func:`dflash_jax.runtime.fingerprint.tree_fingerprint`); ``params``: the tree, or a
    module or ``nnx.State`` of it (:func:`~dflash_jax.nn.module.tree_of`: the same fingerprint)."""
    return tree_fingerprint(tree_of(params))


def _compute(params, cfg: DrafterConfig, tc: TrainConfig):
    if tc.compute_dtype == "float32":
        return params, cfg.with_dtype("float32")
    dt = jnp.dtype(tc.compute_dtype)
    return jax.tree_util.tree_map(lambda p: p.astype(dt), params), cfg.with_dtype(tc.compute_dtype)


def batch_loss(params, cfg: DrafterConfig, target_params, target_cfg: TargetConfig, tc: TrainConfig, batch: dict, key, draft_ids=None):
    """Anchors from ``key``, features from the batch (or recomputed by the frozen target), then
    :func:`dflash_jax.train.objective.dflash_loss` (over ``draft_ids`` when given) of the drafter
    ``params`` (:attr:`TrainState.params`, read as its tree at trace time, or a tree). Returns
    ``(loss, metrics)``."""
    tokens, mask = batch["tokens"], batch["loss_mask"]
    feats = batch.get("features")
    if feats is None:
        feats = jax.lax.stop_gradient(target_features(target_params, target_cfg, tokens, cfg.target_layer_ids, cfg.post_norm_last))
    anchors, valid = objective.sample_anchors(key, mask, tc.num_anchors)
    p, c = _compute(tree_of(params), cfg, tc)
    tp = jax.lax.stop_gradient(target_params)
    return objective.dflash_loss(p, c, tp, target_cfg, tokens, mask, feats, anchors, valid, tc.gamma, draft_ids, batch.get("labels"))


def apply_step(state: TrainState, target_params, batch: dict, cfg: DrafterConfig, target_cfg: TargetConfig, tc: TrainConfig,
               draft_ids=None):
    """The body of :func:`train_step`, not jitted (:mod:`dflash_jax.train.mesh` jits it with the
    shardings of a device mesh): the gradients and the optax update are ``nnx.State`` pytrees
    shaped like ``state.params``."""
    rng, key = jax.random.split(state.rng)
    (loss, m), grads = jax.value_and_grad(batch_loss, has_aux=True)(state.params, cfg, target_params, target_cfg, tc, batch, key, draft_ids)
    updates, opt_state = make_optimizer(tc).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(m, loss=loss, grad_norm=_global_norm(grads), lr=lr_schedule(tc)(state.step))
    return TrainState(params=params, opt_state=opt_state, rng=rng, step=state.step + 1), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "target_cfg", "tc"), donate_argnames=("state",))
def train_step(state: TrainState, target_params, batch: dict, cfg: DrafterConfig, target_cfg: TargetConfig, tc: TrainConfig, draft_ids=None):
    """One optimizer step (jitted; ``state`` donated).

    Args:
      state: :class:`TrainState` (its params the drafter module's ``nnx.State``).
      target_params: the frozen target pytree (never differentiated).
      batch: ``tokens [B, S]`` int32, ``loss_mask [B, S]`` float32 and optionally cached
        ``features [B, S, K*H]`` (recomputed with the target when absent) and ``labels [B, S]``
        int32 (``Batcher(labels="target")``; default the tokens).
      draft_ids: ``[Vd]`` int32 draft vocabulary (``tc.draft_vocab`` ids) or ``None``.
    Returns:
      ``(state, metrics)``: metrics are float32 scalars ``loss``, ``acc``, ``accept_len``,
      ``grad_norm``, ``lr``, ``weight_sum``, ``blocks``.
    """
    return apply_step(state, target_params, batch, cfg, target_cfg, tc, draft_ids)
