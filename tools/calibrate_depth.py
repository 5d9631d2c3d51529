"""Calibration of a drafter's confidences for the adaptive depth policy (``n_max="auto"``).

Greedy speculative decoding at the drafter's full depth (``block_size - 1`` drafts verified every
step, so every position's acceptance is observed), on prompts that are neither evaluation set:
``tools/prompts.py``'s calibration prompts (8 chat, 8 functions of our own asked as HumanEval
asks) and ``tools/make_train_data.py``'s held-out prompts (never trained on). Each step records
the drafter's confidence per position (its top probability) and how many drafts the target
accepted. Position ``i``'s acceptance given that drafts ``1..i-1`` were accepted is fitted by
logistic regression on ``logit(confidence_i)`` (Platt scaling per position: a scale and a bias,
L2-pulled towards the identity), and written into the drafter's ``config.json``
(``dflash_jax.depth_calibration``, with how it was fitted, and ``dflash_jax.n_max = "auto"``).

HumanEval prompts (``--eval``) only evaluate: the calibration plot and table show predicted
survival (raw and fitted) against observed acceptance per position on both sets::

    python tools/calibrate_depth.py                      # fit, write the shipped drafter, plot
    python tools/calibrate_depth.py --no-write --eval 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from prompts import calibration_prompts, humaneval_chat_prompts  # noqa: E402

L2 = 1.0  # pull of (scale - 1, bias) towards the identity, in units of one sample's log-loss


def record_steps(target, drafter, prompts: list[list[int]], max_new: int, max_len: int):
    """Greedy decoding of all ``prompts`` in one batch, verifying every draft: returns
    ``(conf [N, n], accepted [N], n_valid [N], row [N])`` over the steps of running rows, in
    step order (a row's last step, whose acceptance a stop or the budget may cut, is left out)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.decode import loop as decode
    from dflash_jax.decode import step as speculative
    from dflash_jax.decode.static import Decoding, Params
    from dflash_jax.decode.step import block_positions, propose_fn

    n = drafter.cfg.block_size - 1
    static, params = Decoding(target.cfg, drafter.cfg, n_max=n), Params(target.params, drafter.params)
    draft = jax.jit(propose_fn, static_argnames=("static",))
    st = decode.init_state(static, prompts, max_len, max_new, target.eos_ids)
    st = decode.prefill(params, st, static, 256)
    confs, accs, valids, rows = [], [], [], []
    while not bool(jax.device_get(jnp.all(st.done))):
        drafts, conf = draft(params, st, static)
        running, before = jax.device_get((~st.done, st.speculative.accepted))
        n_valid = jax.device_get(block_positions(st, n + 1)[2] - 1)
        st = speculative.verify_block(params, st, static, drafts)
        acc, done = jax.device_get((st.speculative.accepted - before, st.done))
        keep = running & ~done
        confs.append(np.asarray(conf)[keep]), accs.append(acc[keep]), valids.append(n_valid[keep]), rows.append(np.flatnonzero(keep))
    return np.concatenate(confs), np.concatenate(accs), np.concatenate(valids), np.concatenate(rows)


def logit(p):
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


def fit_prompts() -> list[str]:
    from make_train_data import held_out_prompts

    return calibration_prompts() + held_out_prompts()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--eval", type=int, default=24, help="first N HumanEval prompts to evaluate on (never fitted)")
    p.add_argument("--no-write", action="store_true", help="leave the drafter's config.json and the plot alone")
    p.add_argument("--save", default=None, metavar="NPZ", help="also save the recorded steps of every set")
    args = p.parse_args(argv)

    import dflash_jax as dj
    from dflash_jax.assets.default_model import shipped_drafter_path

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    texts = fit_prompts()
    fit = record_steps(target, drafter, [dj.encode_prompt(target, t) for t in texts], args.max_new_tokens, args.max_len)
    n = drafter.cfg.block_size - 1
    scale, bias = zip(*[fit_position(*conditional_samples(*fit[:3], i)) for i in range(1, n + 1)])
    sets = {"fit prompts": fit}
    if args.eval:
        he = [dj.encode_prompt(target, t) for t in humaneval_chat_prompts()[: args.eval]]
        sets[f"HumanEval first {args.eval} (eval only)"] = record_steps(target, drafter, he, args.max_new_tokens, args.max_len)
    reports = {name: report(*s[:3], scale, bias) for name, s in sets.items()}
    if args.save:
        np.savez(args.save, **{f"{i}_{k}": v for i, s in enumerate(sets.values()) for k, v in zip(("conf", "acc", "n_valid", "row"), s)})
    cmd = "python tools/calibrate_depth.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = dict(
        scale=[round(v, 5) for v in scale], bias=[round(v, 5) for v in bias],
        method="per-position Platt scaling: P(accept draft i | drafts 1..i-1 accepted) = sigmoid(scale_i * logit(c_i) + bias_i), "
               f"c_i the drafter's top probability at position i; log-loss + {L2} * ((scale - 1)^2 + bias^2), BFGS",
        data=f"greedy, every draft verified (n_max {n}), {args.max_new_tokens} new tokens, {len(texts)} prompts: "
             "tools/prompts.py calibration_prompts() + tools/make_train_data.py held_out_prompts(); HumanEval not used",
        steps=int(len(fit[1])), samples_per_position=reports["fit prompts"]["samples"],
        fit_set=reports["fit prompts"], command=cmd.strip(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    print(json.dumps(dict(record=record, reports=reports), indent=1))
    if not args.no_write:
        path = shipped_drafter_path(target.source) / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config["dflash_jax"]["n_max"] = "auto"
        config["dflash_jax"]["depth_calibration"] = record
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        plot(sets, scale, bias, REPO / "tools" / "results" / "calibration.png")
        print(f"wrote {path} and tools/results/calibration.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
