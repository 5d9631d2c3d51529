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
import os
import shlex
import sys
from pathlib import Path

from dflash_jax.cli.options import help_text, integer
from dflash_jax.errors import DFlashError, option_error


def written_config() -> str:
    """The file calibrate-depth writes without ``--no-write``, for ``--help``: the ``config.json`` of
    the drafter shipped for the default target (the only drafter shipped; a pattern if there are several)."""
    from dflash_jax.assets.default_model import DRAFTERS_DIR

    configs = sorted(DRAFTERS_DIR.glob("*/config.json"))
    return str(configs[0]) if len(configs) == 1 else str(DRAFTERS_DIR / "<drafter of the default target>" / "config.json")


PARSER_TEXT = help_text(__doc__)
PARSER_TEXT["epilog"] += (f"\n\nWithout --no-write it rewrites {written_config()}\n(inside the installed package; "
                          "an error, before decoding starts, when that file or its folder is not writable).")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the options of ``dflash-jax calibrate-depth`` to ``p``; returns ``p``."""
    p.add_argument("--max-new-tokens", type=integer, default=128, metavar="N", help="new tokens per prompt (default 128)")
    p.add_argument("--max-len", type=integer, default=768, metavar="N", help="capacity per row in tokens (default 768)")
    p.add_argument("--eval", type=integer, default=24, metavar="N",
                   help="first N HumanEval prompts to evaluate on, never fitted (default 24; 0: none)")
    p.add_argument("--no-write", action="store_true",
                   help="only print the fit (default: write it into the shipped drafter's config.json, the file named below)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the calibration plot there (default: no plot)")
    p.add_argument("--save", default=None, metavar="NPZ", help="also save the recorded steps of every set")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def check_writable(path: Path, writable: bool | None = None) -> None:
    """Refuses (DFlashError naming ``path`` and ``--no-write``) a ``config.json`` that is not
    writable, or whose folder is not (``writable``: already known, else asked of the OS)."""
    if writable is None:
        writable = os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
    if not writable:
        raise DFlashError(str(path), "not writable (the shipped drafter's config.json, inside the installed package)",
                          "write access to it and its folder, or --no-write to only print the fit")


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
    path = shipped_drafter_path(target) / "config.json"
    if not args.no_write:
        check_writable(path)  # before the minutes of decoding

    def record(prompts):  # errors name the command's options
        try:
            return record_steps(target, drafter, prompts, args.max_new_tokens, args.max_len)
        except DFlashError as e:
            raise option_error(e) from None

    texts = fit_prompts()
    fit = record([dj.encode_prompt(target, t) for t in texts])
    n = drafter.cfg.block_size - 1
    scale, bias = zip(*[fit_position(*conditional_samples(*fit[:3], i)) for i in range(1, n + 1)])
    sets = {"fit prompts": fit}
    if args.eval:
        he = [dj.encode_prompt(target, t) for t in humaneval_chat_prompts()[: args.eval]]
        sets[f"HumanEval first {args.eval} (eval only)"] = record(he)
    reports = {name: report(*s[:3], scale, bias) for name, s in sets.items()}
    if args.save:
        np.savez(args.save, **{f"{i}_{k}": v for i, s in enumerate(sets.values()) for k, v in zip(("conf", "acc", "n_valid", "row"), s)})
    cmd = "dflash-jax calibrate-depth " + " ".join(shlex.quote(a) for a in argv)
    fitted = dict(
        scale=[round(v, 5) for v in scale], bias=[round(v, 5) for v in bias],
        method="per-position Platt scaling: P(accept draft i | drafts 1..i-1 accepted) = sigmoid(scale_i * logit(c_i) + bias_i), "
               f"c_i the drafter's top probability at position i; log-loss + {L2} * ((scale - 1)^2 + bias^2), BFGS",
        data=f"greedy, every draft verified (n_max {n}), {args.max_new_tokens} new tokens, {len(texts)} prompts: "
             "dflash_jax.assets.prompts calibration_prompts() + dflash_jax.train.prompt_lists held_out_prompts(); HumanEval not used",
        steps=int(len(fit[1])), samples_per_position=reports["fit prompts"]["samples"],
        fit_set=reports["fit prompts"], command=cmd.strip(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    print(json.dumps(dict(record=fitted, reports=reports), indent=1))
    if not args.no_write:
        config = json.loads(path.read_text(encoding="utf-8"))
        config["dflash_jax"]["n_max"] = "auto"
        config["dflash_jax"]["depth_calibration"] = fitted
        try:
            path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        except PermissionError:
            check_writable(path, writable=False)
        print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        plot(sets, scale, bias, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
