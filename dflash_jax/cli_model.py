"""The model options ``dflash-jax generate`` and ``dflash-jax serve`` share, and loading what they name.

:func:`add_model_options` adds ``--target``, ``--draft``, ``--no-spec``, ``--block-size``,
``--n-max``, ``--tree``, ``--dtype``, ``--chat-template-kwargs`` and ``--mesh``; :func:`check_model_options` refuses
values and combinations before anything loads; :func:`load_model` loads the target and the drafter
(``--draft``, else the one shipped for the target) and resolves the draft depth.
"""

from __future__ import annotations

import argparse
import json

from dflash_jax.cli_common import choices_metavar, integer, one_of
from dflash_jax.errors import DFlashError
from dflash_jax.loading import DTYPES


def json_object(text: str) -> dict:
    """``type=`` for an option whose value is a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}) (expected a JSON object)") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"got {type(value).__name__} (expected a JSON object)")
    return value


def depth(text: str) -> int | str:
    """``type=`` of ``--n-max``: an integer or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r} (expected an integer or auto)") from None


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Adds the model options (module docstring) to a subcommand's parser."""
    p.add_argument("--target", metavar="PATH", default=None,
                   help="target model: a Hugging Face folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", metavar="PATH", default=None, help="DFlash drafter checkpoint (speculative decoding)")
    p.add_argument("--no-spec", action="store_true", help="force plain (non-speculative) decoding")
    p.add_argument("--block-size", type=integer, default=None, metavar="N", help="speculative block size (drafter default)")
    p.add_argument("--n-max", type=depth, default=None, metavar="N|auto",
                   help="draft tokens verified per step, or 'auto': each step chooses from the drafter's confidences and "
                   "measured costs (default: the drafter's recorded depth, 'auto' for the shipped drafter)")
    p.add_argument("--tree", type=integer, default=None, metavar="N",
                   help="verify a best-first tree of N drafted nodes (1-15) over the drafter's top candidates per step "
                   "(0: a chain of drafts; default: the drafter's recorded tree with its recorded depth)")
    p.add_argument("--dtype", type=one_of(*DTYPES), metavar=choices_metavar(*DTYPES), default="float32",
                   help="compute dtype (default float32)")
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help='extra chat-template variables, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--mesh", metavar="AXES", default=None,
                   help="lay the model and the decode rows out on a device mesh, e.g. data=2,model=2 (rows over data, heads "
                   "and MLP over model, experts over expert; default: one device)")


def check_model_options(args) -> None:
    """Refuses model option values and combinations (DFlashError naming the option)."""
    if args.n_max is not None and args.n_max != "auto" and args.n_max < 1:
        raise DFlashError("--n-max", f"got {args.n_max}", "an integer >= 1 or auto")
    if args.block_size is not None and args.block_size < 2:
        raise DFlashError("--block-size", f"got {args.block_size}", "an integer >= 2")
    if args.n_max == "auto" and args.block_size is not None:
        raise DFlashError("--block-size", "given with --n-max auto (which verifies up to the drafter's whole block)", "one of them")
    if args.tree is not None and args.tree < 0:
        raise DFlashError("--tree", f"got {args.tree}", "an integer >= 0 (0: a chain of drafts)")
    if args.mesh is not None:
        from dflash_jax.sharding import parse_mesh

        parse_mesh(args.mesh)  # the axes and the device count, before anything loads
    for opt, given in (("--n-max", args.n_max is not None), ("--block-size", args.block_size is not None), ("--draft", args.draft is not None),
                       ("--tree", args.tree is not None)):
        if args.no_spec and given:
            raise DFlashError(opt, "conflicts with --no-spec (plain decoding drafts nothing)", f"either {opt} or --no-spec, not both")


def load_drafter_for(args, target):
    """``(drafter or None, why)``: ``--draft``, else the drafter shipped for the target, else none.

    ``--no-spec`` always gives plain decoding; ``why`` says which mode runs and why.
    """
    from dflash_jax import loading

    if args.no_spec:
        return None, "--no-spec"
    if args.draft is not None:
        d = loading.load_drafter(args.draft, target, dtype=args.dtype)
        return d, f"drafter {d.source}"
    d = loading.shipped_drafter(target, dtype=args.dtype)
    if d is None:
        return None, "no drafter ships for this target; --draft PATH to speculate"
    return d, f"shipped drafter {d.source}"


def n_max_for(args, drafter) -> int | str | None:
    """Draft depth from ``--n-max`` / ``--block-size`` (verify width ``n_max + 1``); ``--tree``
    without a drafter is refused here too.

    Errors name the option the user gave: ``--block-size`` is checked against the drafter's
    ``block_size`` here (``check_n_max``, inside ``Decoding``, checks the depth it implies
    and names ``--n-max``); conflicts with ``--no-spec`` are refused before (:func:`check_model_options`).
    """
    n = args.n_max
    opt = "--n-max" if args.n_max is not None else "--block-size"
    if args.block_size is not None:
        if n is not None and n != args.block_size - 1:
            raise DFlashError("--n-max", f"{n} disagrees with --block-size {args.block_size}", f"{args.block_size - 1} (block size - 1), or only one of them")
        n = args.block_size - 1
    if n is not None and drafter is None:
        raise DFlashError(opt, "given without a drafter", "--draft PATH, or a target with a shipped drafter")
    if args.tree is not None and drafter is None:
        raise DFlashError("--tree", "given without a drafter", "--draft PATH, or a target with a shipped drafter")
    if args.block_size is not None and drafter is not None:
        top = drafter.cfg.block_size
        if not 2 <= args.block_size <= top:
            raise DFlashError("--block-size", f"got {args.block_size}", f"an integer in [2, {top}] (the drafter's block_size)")
    return n


def load_model(args):
    """``(target, drafter or None, n_max or None, why)`` of the model options (after
    :func:`check_model_options`); ``why`` says which decoding runs and why."""
    from dflash_jax.loading import load_target

    from dflash_jax.sharding import describe

    target = load_target(args.target, dtype=args.dtype, mesh=args.mesh)
    drafter, why = load_drafter_for(args, target)
    if target.mesh is not None:
        why += f"; mesh {describe(target.mesh)}"
    return target, drafter, n_max_for(args, drafter), why
