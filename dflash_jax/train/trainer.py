"""DFlash drafter training: the driver that runs, pauses and resumes a run in one folder.

Recipe (``docs/specs/dflash.md`` 3.7): AdamW with linear warmup then cosine (or linear) decay,
global-norm gradient clipping, drafter trained from random initialisation with the target's
embedding and LM head frozen; float32 or bfloat16 compute with float32 master weights. The
pieces live beside it: settings and optimizer in :mod:`~dflash_jax.train.optim`, the jitted step
in :mod:`~dflash_jax.train.step`, checkpoints in :mod:`~dflash_jax.train.checkpoint`, tau and
the training curve in :mod:`~dflash_jax.train.evaluation` (re-exported here).

A run lives in one output folder::

    <out>/run.json                 the run's fixed settings (checked on resume)
    <out>/checkpoints/step_XXXXXXXX/{state,meta}  orbax items (:mod:`~dflash_jax.train.checkpoint`)
    <out>/checkpoints/latest.json  the newest complete checkpoint (replaced atomically)
    <out>/log.jsonl                one line of metrics per logged step
    <out>/tau_curve.json           tau versus training tokens (held-out prompts, greedy)

A checkpoint holds everything the step depends on (parameters, optimizer state, step, PRNG key
and the data cursor); batches are a pure function of ``(seed, step)``
(:class:`dflash_jax.train.data.Batcher`), so a resumed run reproduces the uninterrupted one bit
for bit on the same machine, backend and mesh.

On a device mesh (``mesh=``, :mod:`dflash_jax.train.mesh`) the batch's rows split over its
``data`` axis; with several processes (:mod:`dflash_jax.runtime.distributed`) every process calls
:func:`train` with the same arguments, reads only its own rows, and takes part in every step and
checkpoint write; process 0 alone writes ``run.json``, the log and the tau curve (and measures
tau, on its own devices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.runtime import distributed
from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.formats.files import write_text
from dflash_jax.nn.module import tree_of
from dflash_jax.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dflash_jax.train.data import Batcher
from dflash_jax.train.mesh import MeshStep, check_batch_size, place_state, place_target, state_shardings
from dflash_jax.train.evaluation import evaluate_tau, read_jsonl, training_curve, write_training_curve  # noqa: F401 (re-exported)
from dflash_jax.train.optim import TrainConfig, lr_schedule, make_optimizer  # noqa: F401 (re-exported)
from dflash_jax.train.step import TrainState, init_train_state, params_fingerprint, train_step  # noqa: F401 (re-exported)

__all__ = ["TrainConfig", "TrainState", "evaluate_tau", "init_train_state", "latest_checkpoint", "load_checkpoint", "lr_schedule",
           "make_optimizer", "params_fingerprint", "run_signature", "save_checkpoint", "train", "train_step", "training_curve",
           "write_training_curve"]


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


def _check_run_file(out: Path, sig: dict) -> None:
    """Writes ``run.json`` for a new run (process 0); for an existing one, checks that ``sig``
    equals it."""
    run_file = out / "run.json"
    if run_file.is_file():
        saved = json.loads(run_file.read_text(encoding="utf-8"))
        if saved.get("signature") != sig:
            was = saved.get("signature", {})
            diff = sorted(k for k in sig.keys() | was.keys() if was.get(k) != sig.get(k))
            raise DFlashError(str(run_file), f"this run's settings differ from the checkpointed run's ({', '.join(diff)})",
                              "the same drafter, training settings and data, or a new output folder")
    elif distributed.is_leader():
        write_text(run_file, json.dumps({"signature": sig, "created": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))


@contextlib.contextmanager
def _stop_requests():
    """Yields a dict whose ``"flag"`` turns true on SIGTERM/SIGINT (handlers restored after)."""
    stop = {"flag": False}

    def handler(signum, frame):
        stop["flag"] = True

    old = {}
    for sgn in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sgn] = signal.signal(sgn, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield stop
    finally:
        for sgn, h in old.items():
            signal.signal(sgn, h)


class _RunLog:
    """A run's records from step ``start`` on: ``log.jsonl`` (one line per step), ``tau_curve.json``,
    tokens seen and training time, carried over from the checkpoint's ``meta``; only process 0
    writes the files."""

    def __init__(self, out: Path, start: int, meta: dict):
        self.log_path, self.tau_path, self.writes = out / "log.jsonl", out / "tau_curve.json", distributed.is_leader()
        log = [r for r in read_jsonl(self.log_path) if r["step"] <= start]
        if self.writes:
            self.log_path.write_text("".join(json.dumps(r) + "\n" for r in log), encoding="utf-8")
        curve = json.loads(self.tau_path.read_text()) if self.tau_path.is_file() else []
        self.tau_curve = [r for r in curve if r["step"] <= start]
        self.tokens_seen, self.sup_seen, self.seconds0 = int(meta["tokens_seen"]), int(meta["supervised_seen"]), float(meta["seconds"])
        self.t_start = time.time()
        self.window: list = []

    def seconds(self, digits: int = 2) -> float:
        return round(self.seconds0 + time.time() - self.t_start, digits)

    def checkpoint_meta(self, cursor: dict) -> dict:
        return {"tokens_seen": self.tokens_seen, "supervised_seen": self.sup_seen, "seconds": self.seconds(), "cursor": cursor}

    def step(self, step: int, m: dict, tokens: int, supervised: int, dt: float) -> dict:
        """Counts a finished step (``m``: its host metrics) and appends its log line; returns it."""
        self.tokens_seen += tokens
        self.sup_seen += supervised
        self.window = (self.window + [(tokens, dt)])[-20:]
        tok_s = sum(n for n, _ in self.window) / max(sum(t for _, t in self.window), 1e-9)
        rec = {"step": step, "loss": round(m["loss"], 5), "acc": round(m["acc"], 4), "accept_len": round(m["accept_len"], 3),
               "grad_norm": round(m["grad_norm"], 4), "lr": m["lr"], "tokens_seen": self.tokens_seen, "tok_s": round(tok_s, 1),
               "seconds": self.seconds(1)}
        if self.writes:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def tau(self, step: int, r: dict) -> dict:
        """Records a tau evaluation at ``step``; returns it."""
        r.update(step=step, tokens_seen=self.tokens_seen, supervised_seen=self.sup_seen)
        self.tau_curve.append(r)
        if self.writes:
            write_text(self.tau_path, json.dumps(self.tau_curve, indent=1))
        return r


def _start(out: Path, cfg: DrafterConfig, tc: TrainConfig, batcher: Batcher, init_params, mesh):
    """``(state, run log, draft ids or None, the state's shardings or None)`` of a new run, or of
    the newest checkpoint in ``out`` (after checking the run's settings against ``run.json``);
    the state is laid out on ``mesh`` when there is one."""
    if batcher.batch_size != tc.batch_size or batcher.max_len != tc.max_len:
        raise DFlashError("batcher", f"batch {batcher.batch_size}x{batcher.max_len}", f"{tc.batch_size}x{tc.max_len} (TrainConfig)")
    if mesh is not None:
        check_batch_size(mesh, tc.batch_size)
    out.mkdir(parents=True, exist_ok=True)
    state = init_train_state(cfg, tc, init_params)  # checks init_params before anything is written
    _check_run_file(out, run_signature(cfg, tc, batcher, init_params))
    draft_ids = None
    if tc.draft_vocab:
        draft_ids = jnp.asarray(draft_vocab.most_frequent(batcher.flat_labels(), batcher.dataset.loss_mask, tc.draft_vocab, cfg.vocab_size))
    shardings = None
    if mesh is not None:
        shardings = state_shardings(state, tc, mesh)
        state = place_state(state, shardings)
    ck = latest_checkpoint(out / "checkpoints")
    meta: dict = {"tokens_seen": 0, "supervised_seen": 0, "seconds": 0.0}
    if ck is not None:
        state, meta = load_checkpoint(ck, state)
        if meta.get("cursor", batcher.cursor(meta["step"])) != batcher.cursor(meta["step"]):
            raise DFlashError(f"{ck}: data cursor", str(meta["cursor"]), f"{batcher.cursor(meta['step'])} (this run's data order)")
    return state, _RunLog(out, int(meta.get("step", 0)), meta), draft_ids, shardings


def _step(state, step: int, batcher: Batcher, target_params, cfg, target_cfg, tc, draft_ids, run: _RunLog, mstep: MeshStep | None):
    """Runs batch ``step`` (the state's step); returns the new state and the step's log record."""
    if mstep is None:
        b = batcher.batch(step)
        tokens, supervised = int(b.pop("lengths").sum()), int(b["loss_mask"].sum())
        t0 = time.time()
        state, m = train_step(state, target_params, b, cfg, target_cfg, tc, draft_ids)
    else:
        b, (tokens, supervised) = mstep.batch(batcher, step), batcher.counts(step)
        t0 = time.time()
        state, m = mstep(state, target_params, b)
    m = {k: float(v) for k, v in distributed.fetch(m).items()}
    return state, run.step(step + 1, m, tokens, supervised, time.time() - t0)


def _bar(tc: TrainConfig, start: int, progress: bool):
    """The training progress bar (process 0, unless ``progress`` is off)."""
    from tqdm import tqdm

    return tqdm(total=tc.steps, initial=start, desc="train", disable=not progress or not distributed.is_leader(), dynamic_ncols=True,
                mininterval=1.0)


def _summary(start: int, step: int, finished: bool, run: _RunLog, metrics: dict, last_tau, draft_ids) -> dict:
    return {"start": start, "step": step, "finished": bool(finished), "seconds": run.seconds(1), "tokens_seen": run.tokens_seen,
            "supervised_seen": run.sup_seen, "last": metrics, "tau": last_tau, "draft_ids": None if draft_ids is None else np.asarray(draft_ids)}


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` holds on some process (a collective with several processes): a pause
    that one process asks for (a signal, its clock) is taken by all at the same step."""
    return flag if jax.process_count() == 1 else not distributed.everywhere(not flag)


def _evaluator(run: _RunLog, mesh, target_params, target_cfg, cfg, eval_prompts, eval_max_new, stop_ids, draft_ids):
    """``do_eval(step, state) -> tau record``: every process records the step (the same decisions
    follow) and reads the parameters back (a collective on a mesh); process 0 measures tau while
    the others wait on a :class:`~dflash_jax.runtime.distributed.Broadcast` (a wait of any length: the
    next step's collective could time out)."""
    evaluated = distributed.Broadcast("dflash_jax/train/tau") if jax.process_count() > 1 else None

    def do_eval(step: int, state: TrainState):
        params = tree_of(state.params) if mesh is None else distributed.fetch(tree_of(state.params))
        if not distributed.is_leader():
            evaluated.receive()
            return run.tau(step, {}) and None
        tau = run.tau(step, evaluate_tau(target_params, target_cfg, params, cfg, eval_prompts, eval_max_new, stop_ids, draft_ids=draft_ids))
        if evaluated is not None:
            evaluated.send(step)
        return tau

    return do_eval


def train(out_dir: str | os.PathLike, *, target_params, target_cfg: TargetConfig, cfg: DrafterConfig, batcher: Batcher, tc: TrainConfig,
          eval_prompts: Sequence[Sequence[int]] | None = None, eval_max_new: int = 64, eval_every: int = 0,
          stop_ids: Sequence[int] = (), ckpt_every: int = 100, keep: int = 3, time_limit: float | None = None,
          stop_at: int | None = None, progress: bool = True, on_step: Callable[[int, dict], None] | None = None,
          init_params=None, mesh=None) -> tuple[TrainState, dict]:
    """Trains (or resumes) a drafter in ``out_dir``.

    Resumes from the newest checkpoint when there is one; the run's settings
    (:func:`run_signature`) must equal the saved ``run.json``. Checkpoints every ``ckpt_every``
    steps, at ``stop_at``, when ``time_limit`` seconds have passed, on SIGTERM/SIGINT (after the
    current step) and at the end. Tau is measured on ``eval_prompts`` at step 0, every
    ``eval_every`` steps and at the end. Every argument after ``out_dir`` is keyword-only.

    Args:
      target_params: the frozen target's parameters, on one device (laid out on ``mesh`` here).
      batcher: batch source (:class:`dflash_jax.train.data.Batcher`; its ``batch_size`` and
        ``max_len`` must equal ``tc``'s).
      stop_at: pause after this step (checkpointed; a later call continues).
      on_step: called with ``(step, metrics)`` after every step (host floats).
      init_params: a drafter's weights to start from instead of random ones (fine-tuning a
        trained drafter on more data; :func:`init_train_state`); part of the run's signature.
      mesh: ``None`` (one device), a :class:`jax.sharding.Mesh` or ``"data=D,model=M,expert=E"``
        (:func:`dflash_jax.runtime.sharding.parse_mesh`): the step runs on it (module docstring); with
        several processes every process calls :func:`train` alike.
    Returns:
      ``(state, summary)``: summary has ``start`` (the step it resumed at, 0 for a new run), ``step``,
      ``finished`` (bool), ``seconds``, ``tokens_seen``, the last metrics and tau (process 0) and
      ``draft_ids`` (``[Vd]`` int32 or ``None``). On a mesh the state's arrays are laid out on it.
    Raises:
      DFlashError: settings that differ from the checkpointed run's; a batch size that the
        mesh's ``data`` axis does not divide (naming ``--batch-size`` and ``--mesh``).
    """
    from dflash_jax.runtime.sharding import parse_mesh

    mesh = None if mesh is None else parse_mesh(mesh)
    state, run, draft_ids, shardings = _start(Path(out_dir), cfg, tc, batcher, init_params, mesh)
    mstep = None if mesh is None else MeshStep(mesh, shardings, cfg, target_cfg, tc, draft_ids)
    step_params = target_params if mesh is None else place_target(target_params, target_cfg, mesh)
    ckpt_dir, start = Path(out_dir) / "checkpoints", int(distributed.fetch(state.step))

    do_eval = _evaluator(run, mesh, target_params, target_cfg, cfg, eval_prompts, eval_max_new, stop_ids, draft_ids)
    last_tau = run.tau_curve[-1] if run.tau_curve else None
    if start == 0 and not run.tau_curve and eval_prompts:
        last_tau = do_eval(0, state)
    bar, metrics = _bar(tc, start, progress), {}
    step, finished = start, start >= tc.steps
    with _stop_requests() as stop:
        try:
            while step < tc.steps:
                state, metrics = _step(state, step, batcher, step_params, cfg, target_cfg, tc, draft_ids, run, mstep)
                step += 1
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc']:.3f}", tok_s=f"{metrics['tok_s']:.0f}", refresh=False)
                bar.update(1)
                if on_step is not None:
                    on_step(step, metrics)
                if eval_every and step % eval_every == 0 and step < tc.steps and eval_prompts:
                    last_tau = do_eval(step, state)
                    if last_tau:
                        bar.write(f"step {step}: tau {last_tau['tau']:.3f}")
                if step == tc.steps:
                    finished = True
                    break
                pause = _any_process(stop["flag"] or (time_limit is not None and time.time() - run.t_start >= time_limit)
                                     or (stop_at is not None and step >= stop_at))
                if step % ckpt_every == 0 or pause:
                    save_checkpoint(ckpt_dir, state, run.checkpoint_meta(batcher.cursor(step)), keep)
                    if pause:
                        break
            if finished and eval_prompts and (not run.tau_curve or run.tau_curve[-1]["step"] != step):
                last_tau = do_eval(step, state)
            if step != start:
                save_checkpoint(ckpt_dir, state, run.checkpoint_meta(batcher.cursor(step)), keep)
        finally:
            bar.close()
    return state, _summary(start, step, finished, run, metrics, last_tau, draft_ids)
