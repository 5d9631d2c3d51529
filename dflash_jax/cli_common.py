"""The argument parser both command lines share (``dflash-jax generate`` and ``dflash-jax train``).

Usage errors follow the package's one-line contract ``<option>: <what> (expected <what>)``
(:mod:`dflash_jax.errors`) through argparse's own hooks: values are converted by the ``type=``
callables below, whose :class:`argparse.ArgumentTypeError` already carries the whole message;
:class:`Parser` runs with ``exit_on_error=False`` so that argparse hands back the
:class:`argparse.ArgumentError` (with the option's name) instead of printing usage and exiting,
and :meth:`Parser.parse_args` reports leftover arguments from ``parse_known_args``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


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
    ``jax.distributed.initialize`` (:func:`dflash_jax.distributed.initialize`); ``what`` says what
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


__all__ = ["Parser", "UsageError", "choices_metavar", "extra_message", "int_list", "integer", "number", "one_line", "one_of"]
