"""Calibration of a drafter's confidences for the adaptive depth policy (``n_max="auto"``;
``dflash-jax calibrate-depth``, :mod:`dflash_jax.cli.calibrate_depth`).

Greedy speculative decoding at the drafter's full depth (``block_size - 1`` drafts verified every
step, so every position's acceptance is observed) records the drafter's confidence per position
(its top probability) and how many drafts the target accepted (:func:`record_steps`). Position
``i``'s acceptance given that drafts ``1..i-1`` were accepted is fitted by logistic regression on
``logit(confidence_i)`` (:func:`fit_position`: Platt scaling per position, a scale and a bias,
L2-pulled towards the identity); :func:`report` and :func:`plot` compare predicted survival (raw
and fitted) with observed acceptance per position. The fit needs scipy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_jax.errors import DFlashError

L2 = 1.0  # pull of (scale - 1, bias) towards the identity, in units of one sample's log-loss


def record_steps(target, drafter, prompts: list[list[int]], max_new: int, max_len: int):
    """Greedy decoding of all ``prompts`` in one batch, verifying every draft: returns
    ``(conf [N, n], accepted [N], n_valid [N], row [N])`` over the steps of running rows, in
    step order (a row's last step, whose acceptance a stop or the budget may cut, is left out).

    Raises:
      DFlashError: no step recorded (every row stopped or reached ``max_new`` in its first step;
        names ``max_new (--max-new-tokens)`` and asks for more new tokens or more prompts).
    """
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import loop as decode
    from dflash_jax.decode import step as speculative
    from dflash_jax.decode.state import Decoding, Params
    from dflash_jax.decode.step import block_positions

    n = drafter.cfg.block_size - 1
    static, params = Decoding(target.cfg, drafter.cfg, n_max=n), Params(target.state(), drafter.state())
    st = decode.init_state(static, prompts, max_len, max_new, target.eos_ids)
    st = decode.prefill(params, st, static, 256)
    confs, accs, valids, rows = [], [], [], []
    while not bool(jax.device_get(jnp.all(st.done))):
        drafts, conf = speculative.propose_block(params, st, static)
        running, before = jax.device_get((~st.done, st.speculative.accepted))
        n_valid = jax.device_get(block_positions(st, n + 1)[2] - 1)
        st = speculative.verify_block(params, st, static, drafts)
        acc, done = jax.device_get((st.speculative.accepted - before, st.done))
        keep = running & ~done
        confs.append(np.asarray(conf)[keep]), accs.append(acc[keep]), valids.append(n_valid[keep]), rows.append(np.flatnonzero(keep))
    if not sum(len(a) for a in accs):
        raise DFlashError("max_new (--max-new-tokens)", f"{max_new} new tokens per prompt recorded no verify step over "
                          f"{len(prompts)} prompts (a prompt's last step is not recorded: a stop or the budget may cut it)",
                          "more new tokens per prompt (at least 2), or more prompts")
    return np.concatenate(confs), np.concatenate(accs), np.concatenate(valids), np.concatenate(rows)


def logit(p):
    """``log(p / (1 - p))`` of an array, ``p`` clipped to ``[1e-6, 1 - 1e-6]``."""
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p) - np.log1p(-p)


def fit_position(x, y):
    """``(scale, bias)`` of ``P(y) = sigmoid(scale * x + bias)``: log-loss plus :data:`L2`."""
    from scipy.optimize import minimize
    from scipy.special import expit, log_expit

    def loss(theta):
        z = theta[0] * x + theta[1]
        value = -np.sum(y * log_expit(z) + (1 - y) * log_expit(-z)) + L2 * ((theta[0] - 1) ** 2 + theta[1] ** 2)
        r = expit(z) - y
        return value, np.array([np.sum(r * x) + 2 * L2 * (theta[0] - 1), np.sum(r) + 2 * L2 * theta[1]])

    return tuple(float(v) for v in minimize(loss, np.array([1.0, 0.0]), jac=True, method="BFGS").x)


def conditional_samples(conf, acc, n_valid, i):
    """Steps that reached draft ``i`` (1-based) and could accept it: ``(logit(conf_i), accepted_i)``."""
    m = (acc >= i - 1) & (n_valid >= i)
    return logit(conf[m, i - 1]), (acc[m] >= i).astype(np.float64)


def predictions(conf, scale, bias):
    """Calibrated conditional acceptance ``[N, n]`` (the policy's formula)."""
    from scipy.special import expit

    return expit(np.asarray(scale) * logit(conf) + np.asarray(bias))


def report(conf, acc, n_valid, scale, bias) -> dict:
    """Per position: observed survival (fraction of steps, among those that could accept it,
    whose draft ``i`` was accepted), mean predicted survival raw and fitted, and the expected
    calibration error of the conditional predictions (10 bins), raw and fitted."""
    n = conf.shape[1]
    fitted = predictions(conf, scale, bias)
    out = dict(observed=[], raw=[], fitted=[], ece_raw=[], ece_fitted=[], samples=[])
    for i in range(1, n + 1):
        m = n_valid >= i
        out["observed"].append(float(np.mean(acc[m] >= i)))
        out["raw"].append(float(np.mean(np.prod(conf[m, :i], axis=1))))
        out["fitted"].append(float(np.mean(np.prod(fitted[m, :i], axis=1))))
        c = (acc >= i - 1) & m
        y = (acc[c] >= i).astype(float)
        out["samples"].append(int(c.sum()))
        for name, p in (("ece_raw", conf[c, i - 1]), ("ece_fitted", fitted[c, i - 1])):
            bins = np.minimum((p * 10).astype(int), 9)
            out[name].append(float(sum(abs(np.mean(p[bins == k]) - np.mean(y[bins == k])) * np.mean(bins == k) for k in range(10) if (bins == k).any())))
    return {k: [round(v, 4) for v in vs] for k, vs in out.items()}


def plot(sets: dict, scale, bias, path: Path):
    """Writes a PNG to ``path``: survival per position (observed, predicted raw and fitted) and the
    reliability of the conditional predictions, for every set ``{name: record_steps(...)}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, (conf, acc, n_valid, _) in sets.items():
        rep = report(conf, acc, n_valid, scale, bias)
        pos = range(1, conf.shape[1] + 1)
        line = ax[0].plot(pos, rep["observed"], marker="o", label=f"{name}: observed")[0]
        ax[0].plot(pos, rep["fitted"], ls="--", color=line.get_color(), label=f"{name}: predicted (fitted)")
        ax[0].plot(pos, rep["raw"], ls=":", color=line.get_color(), label=f"{name}: predicted (raw)")
        fitted, xs, ys, raw_x = predictions(conf, scale, bias), [], [], []
        for i in range(1, conf.shape[1] + 1):
            c = (acc >= i - 1) & (n_valid >= i)
            xs.append(fitted[c, i - 1]), raw_x.append(conf[c, i - 1]), ys.append((acc[c] >= i).astype(float))
        for p, style, what in ((np.concatenate(xs), "-o", "fitted"), (np.concatenate(raw_x), ":x", "raw")):
            y, edges = np.concatenate(ys), np.linspace(0, 1, 11)
            k = np.minimum(np.digitize(p, edges) - 1, 9)
            pts = [(p[k == b].mean(), y[k == b].mean()) for b in range(10) if (k == b).sum() >= 5]
            ax[1].plot(*zip(*pts), style, color=line.get_color(), label=f"{name}: {what}")
    ax[0].set(xlabel="draft position i", ylabel="P(draft i committed)", title="survival per position")
    ax[1].plot([0, 1], [0, 1], color="grey", lw=0.8)
    ax[1].set(xlabel="predicted P(accept i | 1..i-1 accepted)", ylabel="observed", title="reliability (10 bins, >= 5 samples)")
    ax[0].legend(fontsize=7), ax[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
