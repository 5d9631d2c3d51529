"""The ``dflash-jax`` command line (also ``python -m dflash_jax``): one parser whose subcommands
share :mod:`dflash_jax.cli.options`, dispatched here.

* ``generate`` (:mod:`dflash_jax.cli.generate`): a completion streamed to stdout;
* ``serve`` (:mod:`dflash_jax.cli.serve`): an OpenAI-compatible server;
* ``train`` (:mod:`dflash_jax.cli.train`): trains a drafter;
* ``make-data`` (:mod:`dflash_jax.cli.make_data`): a training dataset for ``train``;
* ``calibrate-depth`` (:mod:`dflash_jax.cli.calibrate_depth`): fits the adaptive depth policy;
* ``--version`` prints the version and exits with 0.

Error contract: bad input (:class:`~dflash_jax.errors.DFlashError`, unreadable files) and usage
errors (unknown options, values of the wrong type) exit with code 2 and one line
``error: <option or file>: <what> (expected <what>)`` on stderr; ``--debug`` adds the traceback
(for errors found after the options parsed). ``--help`` prints help and exits with 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, Sequence

import dflash_jax
from dflash_jax.cli import calibrate_depth as calibrate_cli
from dflash_jax.cli import generate as generate_cli
from dflash_jax.cli import make_data as make_data_cli
from dflash_jax.cli import serve as serve_cli
from dflash_jax.cli import train as train_cli
from dflash_jax.cli.options import Parser, UsageError, one_line


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-jax`` parser: ``--version`` and the subcommands ``generate``
    (:mod:`dflash_jax.cli.generate`), ``serve`` (:mod:`dflash_jax.cli.serve`), ``train``
    (:mod:`dflash_jax.cli.train`), ``make-data`` (:mod:`dflash_jax.cli.make_data`) and
    ``calibrate-depth`` (:mod:`dflash_jax.cli.calibrate_depth`)."""
    parser = Parser(prog="dflash-jax", description="DFlash speculative decoding in JAX.")
    parser.add_argument("--version", action="version", version=dflash_jax.__version__,
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate_cli.add_arguments(sub.add_parser("generate", **generate_cli.PARSER_TEXT))
    serve_cli.add_arguments(sub.add_parser("serve", help="serve a model over an OpenAI-compatible API (dflash-jax serve --help)",
                                           **serve_cli.PARSER_TEXT))
    train_cli.add_arguments(sub.add_parser("train", help="train a DFlash drafter (dflash-jax train --help)", **train_cli.PARSER_TEXT))
    make_data_cli.add_arguments(sub.add_parser("make-data", help="make a training dataset for train (dflash-jax make-data --help)",
                                               **make_data_cli.PARSER_TEXT))
    calibrate_cli.add_arguments(sub.add_parser("calibrate-depth", help="fit the adaptive depth policy of a drafter "
                                               "(dflash-jax calibrate-depth --help)", **calibrate_cli.PARSER_TEXT))
    return parser


def main(argv: Sequence[str] | None = None, fast_exit: bool = False) -> int:
    """Runs the command line; returns the exit code (0 ok, 2 bad input or usage).

    With ``fast_exit`` (the ``dflash-jax`` program, :func:`entry`) a ``generate`` ends the
    process itself once its output is flushed, without Python's teardown: unloading the
    compiled programs and JAX's backend took 0.8-1.1 s after every answer on the CI machine
    (BENCHMARKS.md, "Time to first token"), memory the OS frees at once anyway. Everything a
    run writes (caches, the executable store) is written before its answer."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as e:  # --help (0)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    from dflash_jax.runtime.compiled import enable_compile_cache

    enable_compile_cache()  # every command: a warm run reads its programs back from the cache
    if args.command is None:
        commands = ", ".join(parser.commands())
        print(f"error: COMMAND: missing (expected one of: {commands}; see dflash-jax --help)", file=sys.stderr, flush=True)
        return 2
    if args.command == "train":
        return train_cli.run(args, argv[argv.index("train") + 1 :])
    if args.command == "serve":
        return _reported(lambda: serve_cli.run(args), args)
    if args.command == "make-data":
        return _reported(lambda: make_data_cli.run(args, argv[argv.index("make-data") + 1 :]), args)
    if args.command == "calibrate-depth":
        return _reported(lambda: calibrate_cli.run(args, argv[argv.index("calibrate-depth") + 1 :]), args)
    code = _reported(lambda: generate_cli.run(args), args)
    if fast_exit:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a closed pipe: nothing more can reach the reader
            pass
        os._exit(code)
    return code


def _reported(run: Callable[[], int], args) -> int:
    """``run()``, its errors printed as one ``error:`` line (2; 130 on Ctrl-C)."""
    from dflash_jax.errors import DFlashError

    try:
        return run()
    except DFlashError as e:
        err, msg = e, str(e)
    except OSError as e:
        where = e.filename if e.filename is not None else "file"
        err, msg = e, f"{where}: {e.strerror or e}"
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    if args.debug:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    print(f"error: {one_line(msg)}", file=sys.stderr, flush=True)
    return 2


def entry() -> None:
    """The ``dflash-jax`` program: :func:`main` with ``fast_exit``."""
    sys.exit(main(fast_exit=True))


if __name__ == "__main__":  # pragma: no cover
    entry()
