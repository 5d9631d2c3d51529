"""Measuring a drafter during training: tau on held-out prompts (the inference path), and the
tau-versus-training-tokens curve of a run folder."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.formats.files import atomic_path
from dflash_jax.nn.module import tree_of


def evaluate_tau(
    target_params,
    target_cfg: TargetConfig,
    params,
    cfg: DrafterConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    stop_ids: Sequence[int] = (),
    n_max: int | None = None,
    chunk_size: int = 128,
    draft_ids=None,
) -> dict:
    """Greedy DFlash speculative decoding of ``prompts`` (one batch) and its acceptance.

    Uses :func:`dflash_jax.decode.loop.decode_loop` with the drafter (the inference path), drafter in float32, drafting over
    ``draft_ids`` when given. ``params``: the drafter's parameter tree, or its module's
    ``nnx.State`` (:attr:`~dflash_jax.train.step.TrainState.params`, read as its tree).

    Returns:
      dict: ``tau`` (mean tokens committed per verify step, bonus included: the paper's
      acceptance length), ``accept_per_position`` (fraction of verify steps in which draft
      position ``i + 1`` was accepted), ``new_tokens``, ``verify_steps``, ``seconds``.
    """
    from dflash_jax.decode import loop as decode
    from dflash_jax.decode.state import Decoding, Params
    cfg32 = cfg.with_dtype("float32")
    p32 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree_of(params))
    if draft_ids is not None:
        cfg32, p32 = draft_vocab.attach(cfg32, p32, target_params, draft_ids)
    t0 = time.time()
    max_len = max(len(p) for p in prompts) + int(max_new_tokens)
    static, weights = Decoding(target_cfg, cfg32, n_max=n_max), Params(target_params, p32)
    st = decode.init_state(static, [list(p) for p in prompts], max_len, int(max_new_tokens), stop_ids, 0)
    st = decode.decode_loop(weights, decode.prefill(weights, st, static, chunk_size), static)
    s = jax.device_get(st.speculative)
    steps = int(np.sum(s.verify_steps))
    committed = int(np.sum(jax.device_get(st.committed)))
    return {
        "tau": committed / max(steps, 1),
        "accept_per_position": (np.sum(s.accepted_per_position, axis=0) / max(steps, 1)).round(4).tolist(),
        "new_tokens": int(np.sum(jax.device_get(st.length - st.prompt_len))),
        "verify_steps": steps,
        "seconds": round(time.time() - t0, 2),
    }


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines log (one object per non-empty line); ``[]`` when there is no file."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def training_curve(out_dir: str | os.PathLike, window: int = 50) -> list[dict]:
    """Rows of the tau-versus-tokens curve of a run folder: every tau evaluation with the
    training loss, accuracy and in-training acceptance length averaged over the ``window``
    logged steps before it (``tokens_seen`` counts sequence tokens, ``supervised_seen``
    response tokens)."""
    out = Path(out_dir)
    log = read_jsonl(out / "log.jsonl")
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
