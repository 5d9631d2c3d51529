"""``dflash-jax calibrate-depth``: fits the adaptive depth policy's calibration of the shipped drafter.

Greedy speculative decoding at the drafter's full depth on prompts that are neither evaluation set
(``dflash_jax.assets.prompts``' calibration prompts: 8 chat, 8 functions of our own asked as
HumanEval asks, and ``dflash-jax make-data``'s held-out prompts, never trained on); each draft
position's acceptance is fitted by per-position Platt scaling (:mod:`dflash_jax.decode.auto.calibrate`)
and written into the drafter's ``config.json`` (``dflash_jax.depth_calibration``, with how it was
fitted, and ``dflash_jax.n_max = "auto"``). Prints the record and the reports as JSON.

HumanEval prompts (``--eval``) only evaluate: the plot (``--plot``) and the reports show predicted
survival (raw and fitted) against observed acceptance per position on both sets. Needs scipy::

    dflash-jax calibrate-depth --plot docs/results/calibration.png   # fit, write the shipped drafter, plot
    dflash-jax calibrate-depth --no-write --eval 16
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shlex
import sys
from pathlib import Path

from dflash_jax.cli.options import integer
from dflash_jax.errors import DFlashError

PARSER_TEXT = dict(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the options of ``dflash-jax calibrate-depth`` to ``p``; returns ``p``."""
    p.add_argument("--max-new-tokens", type=integer, default=128, metavar="N", help="new tokens per prompt (default 128)")
    p.add_argument("--max-len", type=integer, default=768, metavar="N", help="capacity per row in tokens (default 768)")
    p.add_argument("--eval", type=integer, default=24, metavar="N",
                   help="first N HumanEval prompts to evaluate on, never fitted (default 24; 0: none)")
    p.add_argument("--no-write", action="store_true", help="leave the drafter's config.json alone")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the calibration plot there (default: no plot)")
    p.add_argument("--save", default=None, metavar="NPZ", help="also save the recorded steps of every set")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def fit_prompts() -> list[str]:
    """The prompts the calibration is fitted on: ``calibration_prompts()`` and the self-distillation
    recipe's held-out prompts (neither trained on nor an evaluation set)."""
    from dflash_jax.assets.prompts import calibration_prompts
    from dflash_jax.train.prompt_lists import held_out_prompts

    return calibration_prompts() + held_out_prompts()


def _check(args) -> None:
    for name, low in (("max_new_tokens", 1), ("max_len", 2), ("eval", 0)):
        if getattr(args, name) < low:
            raise DFlashError("--" + name.replace("_", "-"), f"got {getattr(args, name)}", f"an integer >= {low}")
    if importlib.util.find_spec("scipy") is None:
        raise DFlashError("calibrate-depth", "needs scipy (the fit), which is not installed", "pip install scipy")


def run(args, argv) -> int:
    """Fits and (unless ``--no-write``) writes the calibration; returns 0. Raises DFlashError on
    bad input (:mod:`dflash_jax.cli.main` prints it)."""
    _check(args)
    import numpy as np

    import dflash_jax as dj
    from dflash_jax.assets.prompts import humaneval_chat_prompts
    from dflash_jax.decode.auto.calibrate import L2, conditional_samples, fit_position, plot, record_steps, report
    from dflash_jax.loading import shipped_drafter_path

    target = dj.load_target()
    drafter = dj.shipped_drafter(target)
    if drafter is None:
        raise DFlashError(f"{target.source}", "no drafter ships for this target", "the default target, whose drafter ships")
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
    cmd = "dflash-jax calibrate-depth " + " ".join(shlex.quote(a) for a in argv)
    record = dict(
        scale=[round(v, 5) for v in scale], bias=[round(v, 5) for v in bias],
        method="per-position Platt scaling: P(accept draft i | drafts 1..i-1 accepted) = sigmoid(scale_i * logit(c_i) + bias_i), "
               f"c_i the drafter's top probability at position i; log-loss + {L2} * ((scale - 1)^2 + bias^2), BFGS",
        data=f"greedy, every draft verified (n_max {n}), {args.max_new_tokens} new tokens, {len(texts)} prompts: "
             "dflash_jax.assets.prompts calibration_prompts() + dflash_jax.train.prompt_lists held_out_prompts(); HumanEval not used",
        steps=int(len(fit[1])), samples_per_position=reports["fit prompts"]["samples"],
        fit_set=reports["fit prompts"], command=cmd.strip(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    print(json.dumps(dict(record=record, reports=reports), indent=1))
    if not args.no_write:
        path = shipped_drafter_path(target) / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config["dflash_jax"]["n_max"] = "auto"
        config["dflash_jax"]["depth_calibration"] = record
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        plot(sets, scale, bias, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
