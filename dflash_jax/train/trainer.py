"""DFlash drafter training: optimizer, jitted step, tau evaluation, exact-resume checkpoints.

Recipe (``docs/specs/dflash.md`` 3.7): AdamW with linear warmup then cosine (or linear) decay,
global-norm gradient clipping, drafter trained from random initialisation with the target's
embedding and LM head frozen; float32 or bfloat16 compute with float32 master weights.

A run lives in one output folder::

    <out>/run.json                 the run's fixed settings (checked on resume)
    <out>/checkpoints/step_XXXXXXXX/{params,opt_state}.safetensors + state.json
    <out>/checkpoints/latest.json  the newest complete checkpoint (replaced atomically)
    <out>/log.jsonl                one line of metrics per logged step
    <out>/tau_curve.json           tau versus training tokens (held-out prompts, greedy)

A checkpoint holds everything the step depends on (parameters, optimizer state, step, PRNG key
and the data cursor); batches are a pure function of ``(seed, step)``
(:class:`dflash_jax.train.data.Batcher`), so a resumed run reproduces the uninterrupted one bit
for bit on the same machine and backend.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax import draft_vocab
from dflash_jax.errors import DFlashError
from dflash_jax.models import drafter
from dflash_jax.models.dense import stack_layers
from dflash_jax.train import objective
from dflash_jax.train.data import Batcher, target_features, tree_fingerprint
from dflash_jax.io.files import atomic_path, write_safetensors, write_text

DECAYS = ("cosine", "linear", "constant")
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static training settings (hashable: a jit static argument).

    Attributes:
      steps: total optimizer steps (the schedule's length).
      batch_size: sequences per step; max_len: padded sequence length ``S`` (tokens).
      num_anchors: blocks per sequence (``docs/specs/dflash.md`` 3.3; ``~ S / block_size`` covers
        every position once per step on average).
      gamma: loss position decay (3.6; 7 for block size 16; <= 0: no decay).
      draft_vocab: 0 trains over the target's whole vocabulary; ``Vd > 0`` over the ``Vd``
        tokens most frequent in the data's responses (:mod:`dflash_jax.draft_vocab`), which the
        exported drafter then drafts over.
      lr: peak learning rate; warmup_ratio: fraction of ``steps`` of linear warmup from 0;
      decay: ``"cosine"``, ``"linear"`` or ``"constant"`` after warmup, down to
      ``lr * final_lr_ratio``.
      weight_decay, b1, b2, eps: AdamW (decoupled weight decay on every parameter).
      grad_clip: global-norm clip (0 = off).
      compute_dtype: ``"float32"`` or ``"bfloat16"`` forward/backward (master weights float32).
      seed: initialisation, anchor sampling and data order.
      init_scale: standard deviation of the random initial weights.
    """

    steps: int = 1000
    batch_size: int = 8
    max_len: int = 512
    num_anchors: int = 32
    gamma: float = 7.0
    draft_vocab: int = 0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    decay: str = "cosine"
    final_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    compute_dtype: str = "float32"
    seed: int = 0
    init_scale: float = 0.02

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise DFlashError("decay (--decay)", f"got {self.decay!r}", f"one of {DECAYS}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise DFlashError("compute_dtype (--dtype)", f"got {self.compute_dtype!r}", f"one of {COMPUTE_DTYPES}")
        for name in ("steps", "batch_size", "max_len", "num_anchors"):
            if int(getattr(self, name)) < 1:
                raise DFlashError(f"{name} (--{name.replace('_', '-')})", f"got {getattr(self, name)}", "an integer >= 1")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise DFlashError("warmup_ratio (--warmup-ratio)", f"got {self.warmup_ratio}", "a fraction in [0, 1)")
        if int(self.draft_vocab) < 0:
            raise DFlashError("draft_vocab (--draft-vocab)", f"got {self.draft_vocab}", "0 (the whole vocabulary) or a size >= 1")
        for name, ok, want in (("lr", self.lr > 0, "a number > 0"), ("gamma", True, "a finite number (<= 0: no decay)"),
                               ("weight_decay", self.weight_decay >= 0, "a number >= 0"),
                               ("grad_clip", self.grad_clip >= 0, "a number >= 0 (0: no clipping)"),
                               ("final_lr_ratio", 0 <= self.final_lr_ratio <= 1, "a fraction in [0, 1]")):
            if not (ok and math.isfinite(getattr(self, name))):
                raise DFlashError(f"{name} (--{name.replace('_', '-')})", f"got {getattr(self, name)}", want)


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    """Learning rate per step: linear warmup over ``round(warmup_ratio * steps)`` steps from 0,
    then ``tc.decay`` to ``lr * final_lr_ratio`` at ``steps``."""
    warm = int(round(tc.warmup_ratio * tc.steps))
    rest = max(tc.steps - warm, 1)
    end = tc.lr * tc.final_lr_ratio
    if tc.decay == "cosine":
        after = optax.cosine_decay_schedule(tc.lr, rest, alpha=tc.final_lr_ratio)
    elif tc.decay == "linear":
        after = optax.linear_schedule(tc.lr, end, rest)
    else:
        after = optax.constant_schedule(tc.lr)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, tc.lr, warm), after], [warm])


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` then AdamW with :func:`lr_schedule`."""
    adam = optax.adamw(lr_schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adam) if tc.grad_clip > 0 else adam


@struct.dataclass
class TrainState:
    """Everything a step changes: float32 drafter ``params``, optax ``opt_state``, the PRNG
    ``rng`` (split once per step) and ``step`` (int32 scalar, the next step's index)."""

    params: dict
    opt_state: object
    rng: jax.Array
    step: jnp.ndarray


def init_train_state(cfg: DrafterConfig, tc: TrainConfig, init_params=None) -> TrainState:
    """Drafter weights and a fresh optimizer state: random (:func:`dflash_jax.models.drafter.init_params`,
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
    (:func:`dflash_jax.train.data.tree_fingerprint`)."""
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
    rng, key = jax.random.split(state.rng)
    (loss, m), grads = jax.value_and_grad(batch_loss, has_aux=True)(state.params, cfg, target_params, target_cfg, tc, batch, key, draft_ids)
    updates, opt_state = make_optimizer(tc).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(m, loss=loss, grad_norm=_global_norm(grads), lr=lr_schedule(tc)(state.step))
    return TrainState(params=params, opt_state=opt_state, rng=rng, step=state.step + 1), metrics


# ------------------------------------------------------------------------------ checkpoints


def _flat(tree, prefix: str) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(jax.device_get(v)) for p, v in leaves}


def _unflat(template, flat: dict, prefix: str, where: str):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for p, v in leaves:
        name = prefix + jax.tree_util.keystr(p, simple=True, separator=".")
        if name not in flat:
            raise DFlashError(f"{where}: tensor {name}", "missing", "a checkpoint of the same drafter and optimizer")
        a = flat[name]
        if tuple(a.shape) != tuple(np.shape(v)) or a.dtype != np.asarray(v).dtype:
            raise DFlashError(f"{where}: tensor {name}", f"{a.dtype}{list(a.shape)}", f"{np.asarray(v).dtype}{list(np.shape(v))}")
        out.append(jnp.asarray(a))
    return jax.tree_util.tree_unflatten(treedef, [o for o in out])


def save_checkpoint(ckpt_dir: str | os.PathLike, state: TrainState, extra: dict, keep: int = 3) -> Path:
    """Writes ``step_XXXXXXXX/`` (params, optimizer state, ``state.json`` with step, PRNG key data
    and ``extra``) into a temporary folder, renames it into place, then points ``latest.json`` at
    it (both renames atomic); keeps the newest ``keep`` checkpoints. Returns the folder."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = int(jax.device_get(state.step))
    name = f"step_{step:08d}"
    final = ckpt_dir / name
    tmp = ckpt_dir / f".{name}.tmp{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_safetensors(tmp / "params.safetensors", _flat(state.params, ""))
    write_safetensors(tmp / "opt_state.safetensors", _flat(state.opt_state, ""))
    rng = np.asarray(jax.device_get(jax.random.key_data(state.rng))).astype(np.uint32)
    meta = dict(extra, step=step, rng=rng.tolist(), rng_impl=str(jax.random.key_impl(state.rng)))
    with open(tmp / "state.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_text(ckpt_dir / "latest.json", json.dumps({"checkpoint": name, "step": step}))
    done = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())
    for old in done[: max(len(done) - keep, 0)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder (``latest.json``, else the highest ``step_*``
    holding ``state.json``), or ``None``."""
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / "latest.json"
    if latest.is_file():
        try:
            p = ckpt_dir / json.loads(latest.read_text(encoding="utf-8"))["checkpoint"]
            if (p / "state.json").is_file():
                return p
        except (ValueError, KeyError):
            pass
    done = sorted(p for p in ckpt_dir.glob("step_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: str | os.PathLike, template: TrainState) -> tuple[TrainState, dict]:
    """Restores a :class:`TrainState` shaped like ``template`` from a checkpoint folder.

    Returns:
      ``(state, meta)`` with ``meta`` the saved ``state.json``.
    Raises:
      DFlashError: a missing or mismatched tensor (names the file and tensor).
    """
    from safetensors.numpy import load_file

    path = Path(path)
    meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    params = _unflat(template.params, load_file(str(path / "params.safetensors")), "", str(path / "params.safetensors"))
    opt = _unflat(template.opt_state, load_file(str(path / "opt_state.safetensors")), "", str(path / "opt_state.safetensors"))
    rng = jax.random.wrap_key_data(jnp.asarray(np.asarray(meta["rng"], np.uint32)), impl=meta.get("rng_impl") or None)
    return TrainState(params=params, opt_state=opt, rng=rng, step=jnp.asarray(meta["step"], jnp.int32)), meta


# ------------------------------------------------------------------------------ evaluation


def evaluate_tau(
    target_params,
    target_cfg: TargetConfig,
    params: dict,
    cfg: DrafterConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    stop_ids: Sequence[int] = (),
    n_max: int | None = None,
    chunk_size: int = 128,
    draft_ids=None,
) -> dict:
    """Greedy DFlash speculative decoding of ``prompts`` (one batch) and its acceptance.

    Uses :mod:`dflash_jax.spec.generate` (the inference path), drafter in float32, drafting over
    ``draft_ids`` when given.

    Returns:
      dict: ``tau`` (mean tokens committed per verify step, bonus included: the paper's
      acceptance length), ``accept_per_position`` (fraction of verify steps in which draft
      position ``i + 1`` was accepted), ``new_tokens``, ``verify_steps``, ``seconds``.
    """
    from dflash_jax.sampling import SamplingConfig
    from dflash_jax.spec import generate as spec

    cfg32 = cfg.with_dtype("float32")
    p32 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
    if draft_ids is not None:
        cfg32, p32 = draft_vocab.attach(cfg32, p32, target_params, draft_ids)
    t0 = time.time()
    max_len = max(len(p) for p in prompts) + int(max_new_tokens)
    st = spec.init_state(target_cfg, cfg32, [list(p) for p in prompts], max_len, int(max_new_tokens), stop_ids, 0, n_max)
    st = spec.prefill(target_params, target_cfg, p32, cfg32, st, chunk_size, SamplingConfig())
    st = spec.generate(target_params, target_cfg, p32, cfg32, st, SamplingConfig())
    s = jax.device_get(st.spec)
    steps = int(np.sum(s.verify_steps))
    committed = int(np.sum(s.committed))
    return {
        "tau": committed / max(steps, 1),
        "accept_per_position": (np.sum(s.accepted_per_position, axis=0) / max(steps, 1)).round(4).tolist(),
        "new_tokens": int(np.sum(jax.device_get(st.length - st.prompt_len))),
        "verify_steps": steps,
        "seconds": round(time.time() - t0, 2),
    }


# ------------------------------------------------------------------------------ driver


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def training_curve(out_dir: str | os.PathLike, window: int = 50) -> list[dict]:
    """Rows of the tau-versus-tokens curve of a run folder: every tau evaluation with the
    training loss, accuracy and in-training acceptance length averaged over the ``window``
    logged steps before it (``tokens_seen`` counts sequence tokens, ``supervised_seen``
    response tokens)."""
    out = Path(out_dir)
    log = _read_jsonl(out / "log.jsonl")
    tau_path = out / "tau_curve.json"
    rows = []
    for r in json.loads(tau_path.read_text(encoding="utf-8")) if tau_path.is_file() else []:
        recent = [x for x in log if r["step"] - window < x["step"] <= r["step"]]
        mean = lambda k: round(float(np.mean([x[k] for x in recent])), 4) if recent else ""  # noqa: E731
        rows.append({"step": r["step"], "tokens_seen": r["tokens_seen"], "supervised_seen": r["supervised_seen"],
                     "tau": round(r["tau"], 4), "train_loss": mean("loss"), "train_acc": mean("acc"), "train_accept_len": mean("accept_len")})
    return rows


CURVE_FIELDS = ["step", "tokens_seen", "supervised_seen", "tau", "train_loss", "train_acc", "train_accept_len", "run"]


def write_training_curve(out_dir: str | os.PathLike, path: str | os.PathLike, before: str | os.PathLike | None = None) -> Path:
    """Writes :func:`training_curve` as CSV to ``path``; returns it.

    Args:
      before: the ``training_curve.csv`` of the drafter this run continued (``init_params``):
        its rows come first and this run's follow with steps and token counts offset by its last
        row's, so the curve runs over all training the drafter had; column ``run`` numbers the
        runs (1 for the first run of the drafter's recorded history; a drafter continued
        without a recorded curve starts its history at this run).
    """
    import csv

    rows, offset, run = [], {"step": 0, "tokens_seen": 0, "supervised_seen": 0}, 1
    if before is not None and Path(before).is_file():
        with open(before, newline="", encoding="utf-8") as f:
            rows = [dict(r, run=int(r.get("run") or 1)) for r in csv.DictReader(f)]
        if rows:
            offset = {k: int(rows[-1][k]) for k in offset}
            run = rows[-1]["run"] + 1
    for r in training_curve(out_dir):
        if rows and r["step"] == 0:
            continue  # the continued drafter's last row measured these weights (before the export's rounding)
        rows.append(dict(r, **{k: r[k] + v for k, v in offset.items()}, run=run))
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CURVE_FIELDS)
        w.writeheader()
        w.writerows(rows)
    return path


def run_signature(cfg: DrafterConfig, tc: TrainConfig, batcher: Batcher, init_params=None) -> dict:
    """The settings a resumed run must share with the run that wrote the checkpoints (with the
    :func:`params_fingerprint` of the initial weights when the run continues a drafter)."""
    d = dataclasses.asdict(cfg)
    d.pop("dtype", None)
    sig = {"drafter": json.loads(json.dumps(d)), "train": dataclasses.asdict(tc), "dataset": batcher.dataset.fingerprint(),
           "features": None if batcher.features is None else batcher.features.meta.get("target")}
    if init_params is not None:
        sig["init"] = params_fingerprint(init_params)
    if batcher.labels != "data":
        sig["labels"] = batcher.labels
    return sig


def train(
    out_dir: str | os.PathLike,
    target_params,
    target_cfg: TargetConfig,
    cfg: DrafterConfig,
    batcher: Batcher,
    tc: TrainConfig,
    *,
    eval_prompts: Sequence[Sequence[int]] | None = None,
    eval_max_new: int = 64,
    eval_every: int = 0,
    stop_ids: Sequence[int] = (),
    ckpt_every: int = 100,
    keep: int = 3,
    time_limit: float | None = None,
    stop_at: int | None = None,
    progress: bool = True,
    on_step: Callable[[int, dict], None] | None = None,
    init_params=None,
) -> tuple[TrainState, dict]:
    """Trains (or resumes) a drafter in ``out_dir``.

    Resumes from the newest checkpoint when there is one; the run's settings
    (:func:`run_signature`) must equal the saved ``run.json``. Checkpoints every ``ckpt_every``
    steps, at ``stop_at``, when ``time_limit`` seconds have passed, on SIGTERM/SIGINT (after the
    current step) and at the end. Tau is measured on ``eval_prompts`` at step 0, every
    ``eval_every`` steps and at the end.

    Args:
      batcher: batch source (:class:`dflash_jax.train.data.Batcher`; its ``batch_size`` and
        ``max_len`` must equal ``tc``'s).
      stop_at: pause after this step (checkpointed; a later call continues).
      on_step: called with ``(step, metrics)`` after every step (host floats).
      init_params: a drafter's weights to start from instead of random ones (fine-tuning a
        trained drafter on more data; :func:`init_train_state`); part of the run's signature.
    Returns:
      ``(state, summary)``: summary has ``step``, ``finished`` (bool), ``seconds``,
      ``tokens_seen``, the last metrics and tau, and ``draft_ids`` (``[Vd]`` int32 or ``None``).
    Raises:
      DFlashError: settings that differ from the checkpointed run's.
    """
    from tqdm import tqdm

    if batcher.batch_size != tc.batch_size or batcher.max_len != tc.max_len:
        raise DFlashError("batcher", f"batch {batcher.batch_size}x{batcher.max_len}", f"{tc.batch_size}x{tc.max_len} (TrainConfig)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoints"
    state = init_train_state(cfg, tc, init_params)  # checks init_params before anything is written
    sig = run_signature(cfg, tc, batcher, init_params)
    run_file = out / "run.json"
    if run_file.is_file():
        saved = json.loads(run_file.read_text(encoding="utf-8"))
        if saved.get("signature") != sig:
            was = saved.get("signature", {})
            diff = sorted(k for k in sig.keys() | was.keys() if was.get(k) != sig.get(k))
            raise DFlashError(str(run_file), f"this run's settings differ from the checkpointed run's ({', '.join(diff)})",
                              "the same drafter, training settings and data, or a new output folder")
    else:
        write_text(run_file, json.dumps({"signature": sig, "created": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))

    draft_ids = None
    if tc.draft_vocab:
        draft_ids = jnp.asarray(draft_vocab.most_frequent(batcher.flat_labels(), batcher.dataset.loss_mask, tc.draft_vocab, cfg.vocab_size))
    ck = latest_checkpoint(ckpt_dir)
    meta: dict = {"tokens_seen": 0, "supervised_seen": 0, "seconds": 0.0}
    if ck is not None:
        state, meta = load_checkpoint(ck, state)
    start = int(state.step)
    log_path, tau_path = out / "log.jsonl", out / "tau_curve.json"
    log = [r for r in _read_jsonl(log_path) if r["step"] <= start]
    log_path.write_text("".join(json.dumps(r) + "\n" for r in log), encoding="utf-8")
    tau_curve = [r for r in (json.loads(tau_path.read_text()) if tau_path.is_file() else []) if r["step"] <= start]
    tokens_seen, sup_seen, seconds0 = int(meta["tokens_seen"]), int(meta["supervised_seen"]), float(meta["seconds"])

    stop = {"flag": False}

    def handler(signum, frame):
        stop["flag"] = True

    old_handlers = {}
    for sgn in (signal.SIGTERM, signal.SIGINT):
        try:
            old_handlers[sgn] = signal.signal(sgn, handler)
        except ValueError:  # not the main thread
            pass

    def extra():
        return {"tokens_seen": tokens_seen, "supervised_seen": sup_seen, "seconds": round(seconds0 + time.time() - t_start, 2),
                "cursor": batcher.cursor(int(state.step))}

    def do_eval(step):
        if not eval_prompts:
            return None
        r = evaluate_tau(target_params, target_cfg, state.params, cfg, eval_prompts, eval_max_new, stop_ids, draft_ids=draft_ids)
        r.update(step=step, tokens_seen=tokens_seen, supervised_seen=sup_seen)
        tau_curve.append(r)
        write_text(tau_path, json.dumps(tau_curve, indent=1))
        return r

    t_start = time.time()
    last_tau = tau_curve[-1] if tau_curve else None
    if start == 0 and not tau_curve:
        last_tau = do_eval(0)
    bar = tqdm(total=tc.steps, initial=start, desc="train", disable=not progress, dynamic_ncols=True, mininterval=1.0)
    metrics: dict = {}
    window = []
    finished = start >= tc.steps
    try:
        while int(state.step) < tc.steps:
            step = int(state.step)
            b = batcher.batch(step)
            lengths = b.pop("lengths")
            t0 = time.time()
            state, m = train_step(state, target_params, b, cfg, target_cfg, tc, draft_ids)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            dt = time.time() - t0
            tokens_seen += int(lengths.sum())
            sup_seen += int(b["loss_mask"].sum())
            window = (window + [(int(lengths.sum()), dt)])[-20:]
            tok_s = sum(n for n, _ in window) / max(sum(t for _, t in window), 1e-9)
            rec = {"step": step + 1, "loss": round(m["loss"], 5), "acc": round(m["acc"], 4), "accept_len": round(m["accept_len"], 3),
                   "grad_norm": round(m["grad_norm"], 4), "lr": m["lr"], "tokens_seen": tokens_seen, "tok_s": round(tok_s, 1),
                   "seconds": round(seconds0 + time.time() - t_start, 1)}
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            metrics = rec
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}", tok_s=f"{tok_s:.0f}", refresh=False)
            bar.update(1)
            if on_step is not None:
                on_step(step + 1, rec)
            s1 = step + 1
            if eval_every and s1 % eval_every == 0 and s1 < tc.steps:
                last_tau = do_eval(s1)
                bar.write(f"step {s1}: tau {last_tau['tau']:.3f}" if last_tau else "")
            over_time = time_limit is not None and time.time() - t_start >= time_limit
            if s1 == tc.steps:
                finished = True
                break
            if s1 % ckpt_every == 0 or stop["flag"] or over_time or (stop_at is not None and s1 >= stop_at):
                save_checkpoint(ckpt_dir, state, extra(), keep)
                if stop["flag"] or over_time or (stop_at is not None and s1 >= stop_at):
                    break
        if finished and (not tau_curve or tau_curve[-1]["step"] != int(state.step)):
            last_tau = do_eval(int(state.step))
        if int(state.step) != start:
            save_checkpoint(ckpt_dir, state, extra(), keep)
    finally:
        bar.close()
        for sgn, h in old_handlers.items():
            signal.signal(sgn, h)
    summary = {"step": int(state.step), "finished": bool(finished), "seconds": round(seconds0 + time.time() - t_start, 1),
               "tokens_seen": tokens_seen, "supervised_seen": sup_seen, "last": metrics, "tau": last_tau,
               "draft_ids": None if draft_ids is None else np.asarray(draft_ids)}
    return state, summary
