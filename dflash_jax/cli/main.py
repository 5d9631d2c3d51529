"""The ``dflash-jax`` command line (also ``python -m dflash_jax``).

``dflash-jax generate [PROMPT]`` loads a target (the embedded default unless ``--target``),
applies the chat template (unless ``--raw`` or ``--prompt-ids``), streams the answer to stdout,
then prints one statistics line to stderr. ``--json`` prints a single JSON object on stdout
instead (nothing streamed).

Error contract: bad input (:class:`~dflash_jax.errors.DFlashError`, unreadable files) and usage
errors (unknown options, values of the wrong type) exit with code 2 and one line
``error: <option or file>: <what> (expected <what>)`` on stderr; ``--debug`` adds the traceback
(for errors found after the options parsed). ``--help`` prints help and exits with 0.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import traceback
from typing import Callable, Sequence
from dflash_jax.cli.options import Parser, UsageError, add_process_options, int_list, integer, number, one_line
from dflash_jax.cli.options import add_model_options, check_model_options, load_model
from dflash_jax.cli import serve as serve_cli
from dflash_jax.cli import train as train_cli


DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
# Lets the default model finish typical answers: of ten everyday questions (code, explanations),
# greedy answers ended after 8 to 292 tokens; 128 cut half of them. A cut answer says so on stderr.
DEFAULT_MAX_NEW_TOKENS = 512


def _prompt_ids(text: str) -> list[int]:
    ids = list(int_list(text))
    if not ids:
        raise argparse.ArgumentTypeError("empty list (expected e.g. 1,2,3)")
    return ids


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-jax`` parser: subcommands ``generate``, ``serve`` (:mod:`dflash_jax.cli.serve`) and
    ``train`` (:mod:`dflash_jax.cli.train`)."""
    parser = Parser(prog="dflash-jax", description="DFlash speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate a completion: applies the chat template, streams the answer to stdout and prints "
        "tokens/s and times to stderr.",
    )
    g.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                   help=f"the user message (default: {DEFAULT_PROMPT!r})")
    add_model_options(g)
    g.add_argument("--measure-costs", action="store_true",
                   help="with --n-max auto: measure the step costs again instead of reading them from the cache folder")
    g.add_argument("--max-new-tokens", type=integer, default=None, metavar="N",
                   help=f"new-token budget (default {DEFAULT_MAX_NEW_TOKENS}, or what fits after the prompt in a shorter "
                   "context; an answer it cuts says so on stderr)")
    g.add_argument("--temperature", type=number, default=0.0, metavar="T", help="sampling temperature (default 0 = greedy)")
    g.add_argument("--top-k", type=integer, default=0, metavar="K", help="keep the K most likely tokens (default 0 = off)")
    g.add_argument("--top-p", type=number, default=1.0, metavar="P", help="nucleus sampling mass (default 1 = off)")
    g.add_argument("--seed", type=integer, default=0, help="sampling seed (default 0)")
    g.add_argument("--chunk-size", type=integer, default=256, metavar="N", help="prompt tokens per prefill pass (default 256)")
    g.add_argument("--max-len", type=integer, default=None, metavar="N",
                   help="capacity in tokens, prompt included (default: the smallest of 1024, 2048, 4096, ... that holds prompt + max-new-tokens)")
    g.add_argument("--system", metavar="TEXT", default=None, help="system message for the chat template")
    g.add_argument("--stop", metavar="TEXT", action="append", default=[],
                   help="stop when the output contains TEXT (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    g.add_argument("--raw", action="store_true", help="no chat template (special tokens in the text are still parsed)")
    g.add_argument("--prompt-ids", type=_prompt_ids, default=None, metavar="1,2,3", help="token ids instead of a text prompt")
    g.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    g.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")
    add_process_options(g, "prints")
    serve_cli.add_arguments(sub.add_parser("serve", help="serve a model over an OpenAI-compatible API (dflash-jax serve --help)",
                                           **serve_cli.PARSER_TEXT))
    train_cli.add_arguments(sub.add_parser("train", help="train a DFlash drafter (dflash-jax train --help)", **train_cli.PARSER_TEXT))
    return parser


def _stats_line(stats: dict, finish: str) -> str:
    mode = "plain decoding" if stats.get("mode", "plain") == "plain" else f"{stats['mode']} decoding"
    spec = f"tau {stats['tau']:.2f} over {stats['verify_steps']} verify steps | " if "tau" in stats else ""
    if stats.get("tree"):
        spec += f"tree of {stats['tree']} node{'s' * (stats['tree'] > 1)} | "
    if stats.get("n_max") == "auto":
        spec += f"widths {' '.join(f'{w}:{c}' for w, c in enumerate(stats['widths']) if c)} plain {stats['plain_steps']} | "
    return (
        f"[{mode}] {stats['new_tokens']} new tokens ({finish}) | {spec}"
        f"decode {stats['decode_tokens_per_s']:.2f} tok/s in {stats['decode_time_s']:.3f} s | "
        f"prefill {stats['prompt_tokens']} tokens in {stats['prefill_time_s']:.3f} s | "
        f"compile {stats['compile_time_s']:.2f} s"
    )


def _check_options(args) -> None:
    """Refuses option values and combinations before anything loads (DFlashError naming the option)."""
    from dflash_jax.errors import DFlashError

    if args.prompt_ids is not None:
        if args.prompt is not None:
            raise DFlashError("--prompt-ids", "given together with a PROMPT text", "one of them")
        for opt, given in (("--system", args.system is not None), ("--raw", args.raw),
                           ("--chat-template-kwargs", args.chat_template_kwargs is not None)):
            if given:
                raise DFlashError(opt, "not used with --prompt-ids (the ids are passed as they are)", f"{opt} with a text PROMPT, or the ids alone")
    for name in ("max_new_tokens", "chunk_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise DFlashError("--" + name.replace("_", "-"), f"got {getattr(args, name)}", "an integer >= 1")
    check_model_options(args)
    if args.no_spec and args.measure_costs:
        raise DFlashError("--measure-costs", "conflicts with --no-spec (plain decoding drafts nothing)", "either --measure-costs or --no-spec, not both")
    if not 0 <= args.seed < 2**63:
        raise DFlashError("--seed", f"got {args.seed}", "an integer in [0, 2**63)")
    if args.max_len is not None and args.max_len < 2:
        raise DFlashError("--max-len", f"got {args.max_len}", "an integer >= 2")


def _prompt(args, target) -> list[int]:
    """The prompt ids: ``--prompt-ids``, else PROMPT (or the default question) encoded."""
    from dflash_jax.errors import DFlashError
    from dflash_jax.text import encode_prompt

    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if not text.strip():
        raise DFlashError("PROMPT", "empty text (an unset shell variable?)", "a non-empty prompt, or none for the default question")
    if target.tokenizer is None:
        raise DFlashError(f"{target.source}: tokenizer", "missing, so a text prompt cannot be encoded", "--prompt-ids 1,2,3")
    return encode_prompt(target, text, system=args.system, raw=args.raw, chat_template_kwargs=args.chat_template_kwargs)


def _budget(args, target, prompt_ids) -> int:
    """``--max-new-tokens``, else :data:`DEFAULT_MAX_NEW_TOKENS` capped to the room after the prompt
    (in ``--max-len``, else in the target's ``max_position_embeddings``)."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    room = (args.max_len or target.cfg.max_position_embeddings) - len(prompt_ids)
    return max(1, min(DEFAULT_MAX_NEW_TOKENS, room))


def _streamer(tok, stop, out):
    """``(stream, on_tokens)``: streams one row's text to ``out`` (ids when there is no tokenizer)."""
    from dflash_jax.text import TextStream

    if tok is None:
        def on_ids(new):
            if new[0]:
                out.write(" ".join(str(i) for i in new[0]) + " ")
                out.flush()

        return None, on_ids
    stream = TextStream(tok, stop)

    def on_text(new):
        piece = stream.feed(new[0])
        if piece:
            out.write(piece)
            out.flush()

    return stream, on_text


def _run_generate(args, target, prompt_ids, **kwargs):
    """``driver.generate`` with an API error renamed to the option (or PROMPT) its value came from."""
    from dflash_jax import driver
    from dflash_jax.errors import DFlashError, option_error

    try:
        return driver.generate(target, [prompt_ids], **kwargs)
    except DFlashError as e:
        if e.where == "prompt":
            raise DFlashError("--prompt-ids" if args.prompt_ids is not None else "PROMPT", e.what, e.expected) from e
        mapped = option_error(e)
        if mapped is not e:
            raise mapped from e
        raise


def _generate(args) -> int:
    from dflash_jax import progress
    from dflash_jax.errors import DFlashError, option_error
    from dflash_jax.decode.sampling import SamplingConfig

    from dflash_jax.runtime import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before anything else uses JAX
    _check_options(args)
    leader = distributed.is_leader()
    progress.verbose(sys.stderr.isatty() and leader)  # loading and compile times (DFLASH_JAX_PROGRESS=1/0: always/never)
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except DFlashError as e:
        raise option_error(e) from e
    target, drafter, n_max, why = load_model(args)
    prompt_ids = _prompt(args, target)
    out = sys.stdout if leader else io.StringIO()  # every process runs the same steps; process 0 prints
    stream, on_tokens = (None, None) if args.json else _streamer(target.tokenizer, args.stop, out)
    budget = _budget(args, target, prompt_ids)
    res = _run_generate(args, target, prompt_ids, max_new_tokens=budget, sampling=sampling, max_len=args.max_len,
                        chunk_size=args.chunk_size, stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed,
                        on_tokens=on_tokens, drafter=drafter, n_max=n_max, cost_model="refresh" if args.measure_costs else None,
                        tree=args.tree)
    if args.json:
        obj = dict(prompt_ids=res.prompt_ids[0], output_ids=res.output_ids[0], text=None if res.texts is None else res.texts[0],
                   finish_reason=res.finish_reason[0], top2_logit_gaps=res.top2_logit_gaps[0], stats=res.stats)
        out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        out.flush()
    else:
        if stream is not None:
            out.write(stream.finish())
        out.write("\n")
        out.flush()
        if leader:
            print(_stats_line(res.stats, res.finish_reason[0]) + f" | {why}", file=sys.stderr, flush=True)
        if leader and res.finish_reason[0] == "length" and not args.ignore_eos:
            print(f"note: the answer was cut by the new-token budget ({budget} tokens); "
                  f"--max-new-tokens {2 * budget} lets it run longer", file=sys.stderr, flush=True)
    return 0


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
    code = _reported(lambda: _generate(args), args)
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
