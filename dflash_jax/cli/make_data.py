"""``dflash-jax make-data``: makes a training dataset for ``dflash-jax train``.

Two recipes (:mod:`dflash_jax.train.make_data`), chosen by who writes the answers:

* ``--answers target`` (default, self-distillation): offline prompts (code prompts from the
  standard library's documented functions and general instructions; or, with ``--sources``, the
  HumanEval-style ``complete`` prompt over every documented function of the named sources),
  answered by the target's own greedy decoding, by continuous batching; resumable (answers are
  saved under ``<out>/shards/``; ``--time-limit`` stops starting new prompts);
* ``--answers source``: real functions of ``--sources`` (default ``stdlib``) asked in the HumanEval
  chat format and answered with their own source (no generation: seconds); train on it with
  ``dflash-jax train --labels target``.

With ``--base DATASET`` the base dataset's sequences come first and the prompts it already asks
are skipped. Evaluation prompts (``dflash_jax.assets.prompts``) are held out, HumanEval is never
read. Examples::

    dflash-jax make-data --out data/smollm2 --num-prompts 1024 --time-limit 1800
    dflash-jax make-data --out data/more --base data/smollm2 --sources stdlib,numpy --num-prompts 512
    dflash-jax make-data --answers source --out data/code --base data/smollm2
"""

from __future__ import annotations

import argparse
import json
import shlex
from types import SimpleNamespace

from dflash_jax.cli.options import Parser, choices_metavar, help_text, integer, number, one_of, parse_and_run
from dflash_jax.errors import DFlashError

ANSWERS = ("target", "source")
PARSER_TEXT = help_text(__doc__)
# the options of one recipe only, with their defaults (given with the other recipe: an error)
TARGET_ONLY = dict(num_prompts=1024, code_fraction=0.65, max_new=160, prompt_cap=128, batch_size=32, refill=None,
                   time_limit=None, list_prompts=False)
SOURCE_ONLY = dict(num_sequences=0, max_len=288)


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the options of ``dflash-jax make-data`` to ``ap``; returns ``ap``."""
    ap.add_argument("--out", required=True, metavar="DIR", help="output dataset folder")
    ap.add_argument("--answers", type=one_of(*ANSWERS), default="target", metavar=choices_metavar(*ANSWERS),
                    help="who writes the answers: the target's greedy decoding (default, self-distillation) or the "
                    "functions' own source (train with --labels target)")
    ap.add_argument("--target", default=None, metavar="PATH",
                    help="target .gguf or HF folder (with --answers source: its tokenizer; default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--base", default=None, metavar="DATASET",
                    help="dataset whose sequences come first; prompts it already asks are skipped")
    ap.add_argument("--sources", default=None, metavar="NAMES",
                    help="comma-separated stdlib and/or installed top-level packages, read with ast (never imported): "
                    "--answers target asks the target to complete their documented functions (shuffled with --seed) "
                    "instead of the built-in list; --answers source answers with their source (default stdlib)")
    ap.add_argument("--seed", type=integer, default=0, help="prompt shuffle seed (default 0)")
    t = ap.add_argument_group("--answers target (self-distillation)")
    t.add_argument("--num-prompts", type=integer, default=None, metavar="N",
                   help="prompts to answer: the first of the shuffled list that fit --prompt-cap and --base does not ask (default 1024)")
    t.add_argument("--code-fraction", type=number, default=None, metavar="F",
                   help="share of code prompts in round 1 of the built-in list (default 0.65; round 2 is all code; unused with --sources)")
    t.add_argument("--max-new", type=integer, default=None, metavar="N", help="new tokens per response at most (default 160)")
    t.add_argument("--prompt-cap", type=integer, default=None, metavar="N",
                   help="longest prompt in tokens; longer ones are skipped (default 128)")
    t.add_argument("--batch-size", type=integer, default=None, metavar="N", help="rows decoded together (default 32)")
    t.add_argument("--refill", type=integer, default=None, metavar="N",
                   help="finished rows given new prompts at once (continuous batching; default a quarter of --batch-size)")
    t.add_argument("--time-limit", type=number, default=None, metavar="S",
                   help="seconds; no new prompt starts after this (running ones finish)")
    t.add_argument("--list-prompts", action="store_true", default=None,
                   help="print the shuffled prompt list (before --prompt-cap and --base) and exit")
    s = ap.add_argument_group("--answers source (real source as answers)")
    s.add_argument("--num-sequences", type=integer, default=None, metavar="N",
                   help="code sequences to keep (default 0: every function that fits)")
    s.add_argument("--max-len", type=integer, default=None, metavar="N",
                   help="longest sequence (prompt + answer) in tokens (default 288)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return ap


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``dflash-jax make-data`` on its own."""
    return add_arguments(Parser(prog="dflash-jax make-data", **PARSER_TEXT))


def checked(args) -> SimpleNamespace:
    """``args`` with the recipe's defaults filled in, after refusing options of the other recipe
    and bad values (DFlashError naming the option)."""
    own, other = (TARGET_ONLY, SOURCE_ONLY) if args.answers == "target" else (SOURCE_ONLY, TARGET_ONLY)
    for name in other:
        if getattr(args, name) is not None:
            opt = "--" + name.replace("_", "-")
            raise DFlashError(opt, f"given with --answers {args.answers}", f"--answers {'source' if args.answers == 'target' else 'target'} "
                              f"with {opt}, or no {opt}")
    out = SimpleNamespace(**vars(args))
    for name, default in own.items():
        if getattr(out, name) is None:
            setattr(out, name, default)
    if args.answers == "source":
        out.sources = "stdlib" if out.sources is None else out.sources
        for name, low in (("num_sequences", 0), ("max_len", 2)):
            if getattr(out, name) < low:
                raise DFlashError("--" + name.replace("_", "-"), f"got {getattr(out, name)}", f"an integer >= {low}")
        return out
    for name in ("num_prompts", "max_new", "prompt_cap", "batch_size"):
        if getattr(out, name) < 1:
            raise DFlashError("--" + name.replace("_", "-"), f"got {getattr(out, name)}", "an integer >= 1")
    if not 0 <= out.code_fraction <= 1:
        raise DFlashError("--code-fraction", f"got {out.code_fraction}", "a number in [0, 1]")
    out.refill = max(1, out.batch_size // 4) if out.refill is None else out.refill
    if not 1 <= out.refill <= out.batch_size:
        raise DFlashError("--refill", f"got {out.refill}", f"an integer in [1, --batch-size = {out.batch_size}]")
    return out


def run(args, argv) -> int:
    """Makes the dataset of parsed ``args`` (``argv``: the arguments as given, recorded in its
    ``meta.json``); returns 0. Raises DFlashError on bad input (:mod:`dflash_jax.cli.main` prints it)."""
    from dflash_jax.train import make_data

    args = checked(args)
    command = "dflash-jax make-data " + " ".join(shlex.quote(a) for a in argv)
    if args.answers == "source":
        make_data.make_from_source(args, command.strip())
        return 0
    if args.list_prompts:
        for p in make_data.prompt_list(args)[1][: args.num_prompts]:
            print(json.dumps(p))
        return 0
    make_data.make_distilled(args, command.strip())
    return 0


def main(argv=None) -> int:
    """``dflash-jax make-data`` with ``argv`` (without the program and subcommand names; default
    ``sys.argv[1:]``): 0 when made, 2 after a one-line usage error. DFlashError (bad input found
    after the options parsed) propagates."""
    return parse_and_run(build_parser, run, argv)
