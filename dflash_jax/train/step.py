"""The training state and the jitted training step: anchors sampled, target features taken from
the batch (or recomputed by the frozen target), the DFlash loss, one AdamW update."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from dflash_jax.runtime import carry as pytree
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.drafter import model as drafter
from dflash_jax.nn.params import stack_layers
from dflash_jax.train import objective
from dflash_jax.train.features import target_features, tree_fingerprint
from dflash_jax.train.optim import TrainConfig, lr_schedule, make_optimizer
from dflash_jax.errors import DFlashError

_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


@pytree.dataclass
class TrainState:
    """Everything a step changes: float32 drafter ``params``, optax ``opt_state``, the PRNG
    ``rng`` (split once per step) and ``step`` (int32 scalar, the next step's index)."""

    params: dict
    opt_state: object
    rng: jax.Array
    step: jnp.ndarray


def init_train_state(cfg: DrafterConfig, tc: TrainConfig, init_params=None) -> TrainState:
    """Drafter weights and a fresh optimizer state: random (:func:`dflash_jax.drafter.model.init_params`,
    float32, from ``tc.seed``), or ``init_params`` (a drafter's weights to continue from, cast to
    float32, stacked when given per layer as ``load_drafter`` keeps them on CPU; the run's PRNG
    still comes from ``tc.seed``).

    Raises:
      DFlashError: ``init_params`` whose names or shapes differ from ``cfg``'s drafter.
    """
    k_init, k_run = jax.random.split(jax.random.key(tc.seed))
    init = functools.partial(drafter.init_params, cfg.with_dtype("float32"), scale=tc.init_scale)
    if init_params is None:
        params = init(k_init)
    else:
        init_params = stack_layers(init_params)
        want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(jax.eval_shape(init, k_init))}
        got = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(init_params)}
        if want != got:
            bad = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            raise DFlashError("initial drafter weights", f"{bad[0]} is {got.get(bad[0])}", f"{want.get(bad[0])} (the drafter being trained)")
        params = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32, copy=True), init_params)  # steps donate
    return TrainState(params=params, opt_state=make_optimizer(tc).init(params), rng=k_run, step=jnp.zeros((), jnp.int32))


def params_fingerprint(params) -> str:
    """sha256 (hex, 16 chars) of a parameter pytree's names, shapes and all its float32 values
    (:func:`dflash_jax.runtime.fingerprint.tree_fingerprint`)."""
    return tree_fingerprint(params)


def _compute(params, cfg: DrafterConfig, tc: TrainConfig):
    if tc.compute_dtype == "float32":
        return params, cfg.with_dtype("float32")
    dt = jnp.dtype(tc.compute_dtype)
    return jax.tree_util.tree_map(lambda p: p.astype(dt), params), cfg.with_dtype(tc.compute_dtype)


def batch_loss(params, cfg: DrafterConfig, target_params, target_cfg: TargetConfig, tc: TrainConfig, batch: dict, key, draft_ids=None):
    """Anchors from ``key``, features from the batch (or recomputed by the frozen target), then
    :func:`dflash_jax.train.objective.dflash_loss` (over ``draft_ids`` when given). Returns
    ``(loss, metrics)``."""
    tokens, mask = batch["tokens"], batch["loss_mask"]
    feats = batch.get("features")
    if feats is None:
        feats = jax.lax.stop_gradient(target_features(target_params, target_cfg, tokens, cfg.target_layer_ids, cfg.post_norm_last))
    anchors, valid = objective.sample_anchors(key, mask, tc.num_anchors)
    p, c = _compute(params, cfg, tc)
    tp = jax.lax.stop_gradient(target_params)
    return objective.dflash_loss(p, c, tp, target_cfg, tokens, mask, feats, anchors, valid, tc.gamma, draft_ids, batch.get("labels"))


def apply_step(state: TrainState, target_params, batch: dict, cfg: DrafterConfig, target_cfg: TargetConfig, tc: TrainConfig,
               draft_ids=None):
    """The body of :func:`train_step`, not jitted (:mod:`dflash_jax.train.mesh` jits it with the
    shardings of a device mesh)."""
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
      state: :class:`TrainState`.
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
