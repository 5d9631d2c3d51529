"""The option set every ``dflash-jax`` subcommand shares: the parser, its value converters, the
process options, and the model options of ``generate`` and ``serve`` with loading what they name.

**The parser.** Usage errors follow the package's one-line contract ``<option>: <what> (expected <what>)``
(:mod:`dflash_jax.errors`) through argparse's own hooks: values are converted by the ``type=``
callables below, whose :class:`argparse.ArgumentTypeError` already carries the whole message;
:class:`Parser` runs with ``exit_on_error=False`` so that argparse hands back the
:class:`argparse.ArgumentError` (with the option's name) instead of printing usage and exiting,
and :meth:`Parser.parse_args` reports leftover arguments from ``parse_known_args``.

**The model options.** :func:`add_model_options` adds ``--target``, ``--draft``, ``--no-spec``, ``--block-size``,
``--n-max``, ``--tree``, ``--dtype``, ``--weights``, ``--chat-template-kwargs`` and ``--mesh``; :func:`check_model_options` refuses
values and combinations before anything loads; :func:`load_model` loads the target and the drafter
(``--draft``, else the one shipped for the target) and resolves the draft depth.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Sequence

from dflash_jax.errors import DFlashError
from dflash_jax.loading import DTYPES


class UsageError(Exception):
    """A command-line usage error, already in the ``<option>: <what> (expected <what>)`` form."""


def integer(text: str) -> int:
    """``type=`` for integer options."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r} (expected an integer)") from None


def number(text: str) -> float:
    """``type=`` for real-valued options (``nan``/``inf`` parse; the API refuses them by name)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r} (expected a number)") from None


def one_of(*choices: str):
    """``type=`` for an option with fixed values (pass ``metavar=choices_metavar(...)`` for help)."""

    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"got {text!r} (expected one of: {', '.join(choices)})")
        return text

    check.__name__ = "one_of"
    return check


def choices_metavar(*choices: str) -> str:
    """The ``{a,b,c}`` metavar argparse shows for ``choices=``."""
    return "{" + ",".join(choices) + "}"


def int_list(text: str) -> tuple[int, ...]:
    """``type=`` for comma-separated integers (``1,10,18``); spaces are ignored."""
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r} (expected a comma-separated list of integers, e.g. 1,2,3)") from None


def add_process_options(g, what: str) -> None:
    """``--coordinator HOST:PORT --num-processes N --process-id I``, the names of
    ``jax.distributed.initialize`` (:func:`dflash_jax.runtime.distributed.initialize`); ``what`` says what
    process 0 does (prints, listens, ...)."""
    g.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help=f"run as one of several processes (jax.distributed) whose process 0 listens here for the others; with --mesh "
                   f"over every process's devices; process 0 {what}")
    g.add_argument("--num-processes", type=integer, default=None, metavar="N", help="processes in the group (with --coordinator)")
    g.add_argument("--process-id", type=integer, default=None, metavar="I", help="this process's index in [0, N) (with --coordinator)")


def extra_message(prog: str, extras: Sequence[str]) -> str:
    """The usage error for arguments no option took."""
    first = extras[0]
    if first.startswith("-") and len(first) > 1:
        return f"{first}: unknown option (expected an option listed by {prog} --help)"
    return f"{first}: unexpected extra argument (expected at most one PROMPT; quote a prompt that has spaces)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors raise :class:`UsageError` (one line, no usage
    block). Subparsers inherit the class. ``--help`` still prints help and exits with 0.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """Parses ``args``; raises :class:`UsageError` on a bad command line."""
        try:
            ns, extras = self.parse_known_args(args, namespace)
        except argparse.ArgumentError as e:
            raise UsageError(self._argument_message(e, args)) from None
        if extras:  # named with the subcommand whose options were parsed
            command = getattr(ns, "command", None)
            raise UsageError(extra_message(f"{self.prog} {command}" if command else self.prog, extras))
        return ns

    def parse_known_args(self, args=None, namespace=None):
        """argparse's ``parse_known_args`` (subparsers call it too), except that required options
        left out raise one :class:`UsageError` naming them all (argparse itself reports those
        only as text, through :meth:`error`); an unknown option is reported before them."""
        required = [a for a in self._actions if a.required and a.option_strings]
        self._relaxed = required
        for a in required:
            a.required = False
        try:
            ns, extras = super().parse_known_args(args, namespace)
        finally:
            self._relaxed = []
            for a in required:
                a.required = True
        missing = [a.option_strings[-1] for a in required if getattr(ns, a.dest, None) is None]
        if missing and not extras:
            raise UsageError(f"{', '.join(missing)}: missing (expected a value)")
        return ns, extras

    def format_usage(self):
        """Usage with required options shown as required (also while :meth:`parse_known_args`
        runs, when ``--help`` prints it)."""
        return self._with_required(super().format_usage)

    def format_help(self):
        """Help with required options shown as required (see :meth:`format_usage`)."""
        return self._with_required(super().format_help)

    def _with_required(self, fmt):
        relaxed = getattr(self, "_relaxed", [])
        for a in relaxed:
            a.required = True
        try:
            return fmt()
        finally:
            for a in relaxed:
                a.required = False

    def _argument_message(self, e: argparse.ArgumentError, args) -> str:
        name = (e.argument_name or self.prog).split("/")[-1]
        if "(expected " in e.message:  # from a type= callable above: already complete
            return f"{name}: {e.message}"
        commands = self.commands()
        if commands and name == "COMMAND":  # the only positional of the top level
            argv = sys.argv[1:] if args is None else list(args)
            word = next((a for a in argv if not a.startswith("-")), "")
            return f"{word}: unknown command (expected one of: {', '.join(commands)})"
        if e.message.startswith("ignored explicit argument"):  # a flag given a value
            return f"{name}: {e.message} (expected no value)"
        return f"{name}: missing value (expected a value after {name})"

    def error(self, message):
        """argparse's remaining string-only errors (such as an ambiguous abbreviation): one line
        naming the command."""
        raise UsageError(f"{self.prog}: {message} (expected a valid command line, see {self.prog} --help)")

    def commands(self) -> list[str]:
        """The subcommand names of this parser (none for a leaf parser)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return list(action.choices)
        return []


def one_line(msg) -> str:
    """``msg`` with every run of whitespace (newlines too) turned into one space."""
    return " ".join(str(msg).split())


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # :func:`a.b.c` (shown a.b.c), :func:`~a.b.c` (shown c)


def help_text(doc: str) -> dict:
    """``description=``, ``epilog=`` and ``formatter_class=`` of a subcommand's parser from its
    module docstring ``doc`` (the first paragraph, then the rest, line breaks kept), with the
    Sphinx markup --help would print raw taken out: a role ``:mod:`a.b``` becomes ``a.b``
    (``:func:`~a.b.c``` becomes ``c``), ````x```` becomes ``x``, a closing ``::`` becomes ``:``."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)
    first, _, rest = text.partition("\n\n")
    return dict(description=first, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_and_run(build_parser, run, argv=None) -> int:
    """A subcommand's ``main``: parses ``argv`` (without the program and subcommand names; default
    ``sys.argv[1:]``) with ``build_parser()`` and returns ``run(args, argv)``; after a usage error
    prints ``error: <one line>`` to stderr and returns 2; after ``--help`` returns its exit code (0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    return run(args, argv)


__all__ = ["Parser", "UsageError", "choices_metavar", "extra_message", "help_text", "int_list", "integer", "number", "one_line",
           "one_of", "parse_and_run"]


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
    add_weights_option(p)
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help='extra chat-template variables, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--mesh", metavar="AXES", default=None,
                   help="lay the model and the decode rows out on a device mesh, e.g. data=2,model=2 (rows over data, heads "
                   "and MLP over model, experts over expert; default: one device)")


def add_weights_option(p) -> None:
    """Adds ``--weights`` (:mod:`dflash_jax.weights_choice`) to a parser or argument group: generate,
    serve (through :func:`add_model_options`) and train."""
    from dflash_jax.weights_choice import WEIGHTS

    p.add_argument("--weights", type=one_of(*WEIGHTS), metavar=choices_metavar(*WEIGHTS), default="auto",
                   help="how the weights are held: quantized (a quantized checkpoint kept quantized), float (dequantized), "
                   "int8 (a float checkpoint quantized on load), auto (default: quantized unless float measured faster "
                   "on this backend and it fits; docs/models.md); a drafter follows its target")


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
        from dflash_jax.runtime.sharding import parse_mesh

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
    from dflash_jax.runtime.sharding import describe

    target = load_target(args.target, dtype=args.dtype, mesh=args.mesh, weights=args.weights)
    drafter, why = load_drafter_for(args, target)
    if target.mesh is not None:
        why += f"; mesh {describe(target.mesh)}"
    return target, drafter, n_max_for(args, drafter), why
