"""``dflash-jax generate [PROMPT]``: loads a target (the embedded default unless ``--target``),
applies the chat template (unless ``--raw`` or ``--prompt-ids``), streams the answer to stdout,
then prints one statistics line to stderr. ``--json`` prints a single JSON object on stdout
instead (nothing streamed). :mod:`dflash_jax.cli.main` dispatches to :func:`run`.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from dflash_jax.cli.options import add_process_options, int_list, integer, number
from dflash_jax.cli.options import add_model_options, check_model_options, load_model


DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
# Lets the default model finish typical answers: of ten everyday questions (code, explanations),
# greedy answers ended after 8 to 292 tokens; 128 cut half of them. A cut answer says so on stderr.
DEFAULT_MAX_NEW_TOKENS = 512


def _prompt_ids(text: str) -> list[int]:
    ids = list(int_list(text))
    if not ids:
        raise argparse.ArgumentTypeError("empty list (expected e.g. 1,2,3)")
    return ids


PARSER_TEXT = dict(
    help="generate text from a prompt",
    description="Generate a completion: applies the chat template, streams the answer to stdout and prints "
    "tokens/s and times to stderr.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``generate`` options: PROMPT, the shared model and process options, and the decoding's."""
    p.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                   help=f"the user message (default: {DEFAULT_PROMPT!r})")
    add_model_options(p)
    p.add_argument("--measure-costs", action="store_true",
                   help="with --n-max auto: measure the step costs again instead of reading them from the cache folder")
    p.add_argument("--max-new-tokens", type=integer, default=None, metavar="N",
                   help=f"new-token budget (default {DEFAULT_MAX_NEW_TOKENS}, or what fits after the prompt in a shorter "
                   "context; an answer it cuts says so on stderr)")
    p.add_argument("--temperature", type=number, default=0.0, metavar="T", help="sampling temperature (default 0 = greedy)")
    p.add_argument("--top-k", type=integer, default=0, metavar="K", help="keep the K most likely tokens (default 0 = off)")
    p.add_argument("--top-p", type=number, default=1.0, metavar="P", help="nucleus sampling mass (default 1 = off)")
    p.add_argument("--seed", type=integer, default=0, help="sampling seed (default 0)")
    p.add_argument("--chunk-size", type=integer, default=256, metavar="N", help="prompt tokens per prefill pass (default 256)")
    p.add_argument("--max-len", type=integer, default=None, metavar="N",
                   help="capacity in tokens, prompt included (default: the smallest of 1024, 2048, 4096, ... that holds prompt + max-new-tokens)")
    p.add_argument("--system", metavar="TEXT", default=None, help="system message for the chat template")
    p.add_argument("--stop", metavar="TEXT", action="append", default=[],
                   help="stop when the output contains TEXT (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--raw", action="store_true", help="no chat template (special tokens in the text are still parsed)")
    p.add_argument("--prompt-ids", type=_prompt_ids, default=None, metavar="1,2,3", help="token ids instead of a text prompt")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")
    add_process_options(p, "prints")


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


def run(args) -> int:
    """Generates for parsed ``args``; returns 0 (errors raise :class:`~dflash_jax.errors.DFlashError`)."""
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
