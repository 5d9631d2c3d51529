"""``dflash-jax serve``: the model options of ``generate`` and the server's own, then uvicorn.

With a key (``--api-key``, ``--api-key-file`` or ``$DFLASH_JAX_API_KEY``) ``/v1`` and ``/metrics``
need it; ``/health`` stays open. SIGTERM and SIGINT stop the server gracefully
(:mod:`~dflash_jax.serve.shutdown`): new requests get 503 with ``Retry-After``, running requests get
``--shutdown-timeout`` seconds to finish (then they end with an error, streamed ones with a final
error event), exit code 0. If the engine dies, ``/health`` answers 503, the server stops and the
command exits with 1.

Several processes (``--coordinator``, ``--num-processes``, ``--process-id``, each process started
with the same command but its id): process 0 listens and decides the schedule, the others run the
same device programs (:mod:`~dflash_jax.serve.follow`); a SIGTERM to process 0 stops them all.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from dflash_jax.cli.options import add_process_options, integer, number
from dflash_jax.cli.options import add_model_options, check_model_options, load_model
from dflash_jax.errors import DFlashError, option_error


PARSER_TEXT = dict(
    description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
    "/health, /metrics) with continuous batching and DFlash speculative decoding.",
)

API_KEY_ENV = "DFLASH_JAX_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve`` options: the model options of ``generate`` and the server's."""
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=integer, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-batch", type=integer, default=16, metavar="N", help="rows decoded together (default 16)")
    p.add_argument("--max-len", type=integer, default=1024, metavar="N",
                   help="tokens per request, prompt included (default 1024, at most the target's max_position_embeddings)")
    p.add_argument("--max-queue", type=integer, default=256, metavar="N",
                   help="requests waiting for a row beyond which new ones get 429 (default 256)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 and /metrics (default: ${API_KEY_ENV}, else none; "
                   "a key on the command line shows in ps: prefer --api-key-file or the variable)")
    p.add_argument("--api-key-file", metavar="PATH", default=None, help="read the key from this file (its first line)")
    p.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the model name clients send (default: the target's file or folder name)")
    p.add_argument("--chunk-size", type=integer, default=256, metavar="N", help="prompt tokens per prefill pass (default 256)")
    p.add_argument("--prefix-cache-mb", type=number, default=1024, metavar="MB",
                   help="memory for prefilled prompt blocks reused by later prompts that start with them (default 1024; 0: off)")
    p.add_argument("--kv-cache-mb", type=number, default=None, metavar="MB",
                   help="memory for the target's K/V and the drafter's context of all rows (default: --max-batch rows of --max-len tokens)")
    from dflash_jax.families.registry import TARGET_FAMILIES  # which families page: their declared paged_kv

    unpaged = ", ".join(f.name for f in TARGET_FAMILIES if not f.model.paged_kv)
    p.add_argument("--kv-layout", choices=("paged", "rows"), default="paged",
                   help="paged (default): rows hold pages of 16 tokens from one pool, as many as their tokens fill so far, "
                   "so short requests fit more rows in --kv-cache-mb; rows: every row holds --max-len tokens. Families without "
                   f"paged support ({unpaged}) and targets on a mesh use rows")
    p.add_argument("--steps-per-round", type=integer, default=4, metavar="N",
                   help="decode steps on device per host round trip (default 4)")
    p.add_argument("--shutdown-timeout", type=number, default=30.0, metavar="S",
                   help="seconds running requests get to finish on SIGTERM/SIGINT (default 30)")
    p.add_argument("--max-body-bytes", type=integer, default=4 << 20, metavar="N", help="largest request body (default 4 MiB)")
    p.add_argument("--warm-up", default="all", metavar="SIZES",
                   help="batch sizes to compile (and under --n-max auto measure) before listening: 'all' (default), 'none' or a "
                   "list such as 1,2; the others are compiled by the engine while idle, before the batch grows to them")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    add_process_options(p, "listens on --host/--port and the others follow its schedule")


def api_key(args, environ=None) -> str | None:
    """The server's key: ``--api-key``, else the first line of ``--api-key-file``, else
    ``$DFLASH_JAX_API_KEY``; ``None`` for none of them.

    Raises:
      DFlashError: both options given, an unreadable file, or an empty key (naming the option
        or variable).
    """
    environ = os.environ if environ is None else environ
    if args.api_key is not None and args.api_key_file is not None:
        raise DFlashError("--api-key, --api-key-file", "both given", "one of them")
    if args.api_key is not None:
        key, where = args.api_key, "--api-key"
    elif args.api_key_file is not None:
        where = f"--api-key-file: {args.api_key_file}"
        try:
            text = Path(args.api_key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeError) as e:
            raise DFlashError(where, f"cannot be read ({getattr(e, 'strerror', None) or e})", "a UTF-8 text file holding the key") from None
        key = (text.splitlines() or [""])[0]
    elif API_KEY_ENV in environ:
        key, where = environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None
    key = key.strip()
    if not key:
        raise DFlashError(where, "an empty key", "a non-empty key (or none of --api-key, --api-key-file and $" + API_KEY_ENV + ")")
    return key


def _check(args) -> None:
    from dflash_jax.serve.warmup import parse_sizes

    check_model_options(args)
    parse_sizes(args.warm_up)
    for name in ("max_batch", "max_len", "max_queue", "chunk_size", "steps_per_round", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise DFlashError("--" + name.replace("_", "-"), f"got {getattr(args, name)}", "an integer >= 1")
    if not 0 < args.port < 65536:
        raise DFlashError("--port", f"got {args.port}", "an integer in [1, 65535]")
    if not args.shutdown_timeout >= 0:
        raise DFlashError("--shutdown-timeout", f"got {args.shutdown_timeout}", "a number of seconds >= 0")
    if not 0 <= args.prefix_cache_mb < 2**40:
        raise DFlashError("--prefix-cache-mb", f"got {args.prefix_cache_mb}", "a number of MiB >= 0 (0: no prefix cache)")
    if args.kv_cache_mb is not None and not 0 < args.kv_cache_mb < 2**40:
        raise DFlashError("--kv-cache-mb", f"got {args.kv_cache_mb}", "a number of MiB > 0")


DEFAULT_SHORT_NAME = "smollm2-135m-instruct"
"""The name the embedded default model is served under (its file name is accepted too)."""


def build_engine(args, channel=None):
    """Loads the model of the options and builds the engine (raises DFlashError for bad input)."""
    from dflash_jax.serve.engine import Engine
    from dflash_jax.serve.jobs import ServedModel
    from dflash_jax.serve.metrics import Metrics
    from dflash_jax.serve.warmup import parse_sizes

    target, drafter, n_max, why = load_model(args)
    limit = int(target.cfg.max_position_embeddings)
    if args.max_len > limit:
        raise DFlashError("--max-len", f"{args.max_len} exceeds the target's {limit} positions (max_position_embeddings)", f"an integer in [2, {limit}]")
    if target.tokenizer is None:
        raise DFlashError(f"{target.source}: tokenizer", "missing (a server decodes text)", "a target with a tokenizer")
    if drafter is not None:  # the depth is checked now, not at the first request
        try:
            static = ServedModel(target, drafter, n_max=n_max, tree=args.tree).decoding()
        except DFlashError as e:
            raise option_error(e) from e
        why += f"; n_max {static.n_max}" + (f" over a tree of {static.tree} node{'s' * (static.tree > 1)}" if static.tree else "")
    file_name = Path(target.source).name
    short = DEFAULT_SHORT_NAME if args.target is None else None  # the embedded default model
    name = args.served_model_name or short or file_name
    model = ServedModel(target, drafter, name=name, n_max=n_max, tree=args.tree, chat_template_kwargs=args.chat_template_kwargs,
                        aliases=(file_name,) if short and not args.served_model_name else ())
    engine = Engine(model, max_batch=args.max_batch, max_len=args.max_len, max_queue=args.max_queue, chunk_size=args.chunk_size,
                    steps_per_round=args.steps_per_round, metrics=Metrics(), prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
                    channel=channel, kv_cache_bytes=None if args.kv_cache_mb is None else int(args.kv_cache_mb * 2**20),
                    paged=args.kv_layout == "paged", warm_sizes=parse_sizes(args.warm_up))
    return engine, why


def run(args) -> int:
    """Serves until SIGTERM/SIGINT (exit 0) or until the engine dies (exit 1); a follower process
    returns when process 0's engine stops (:func:`~dflash_jax.serve.follow.follow`)."""
    from dflash_jax.runtime import distributed
    from dflash_jax.serve import follow

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before anything else uses JAX
    _check(args)
    key = api_key(args)
    channel = distributed.Broadcast("dflash_jax/serve") if distributed.process_count() > 1 else None
    engine, why = build_engine(args, channel if distributed.is_leader() else None)
    if channel is not None:
        follow.handshake(channel, args)
        if not distributed.is_leader():
            return follow.follow(engine, channel)
    try:
        return _listen(args, engine, key, why)
    finally:
        if channel is not None:  # the followers stop with the engine
            engine.stop(0)
            channel.send(("stop", (engine.error is None,)))


def _listen(args, engine, key, why) -> int:
    """Runs uvicorn around ``engine`` until a signal or the engine's death (:func:`run`)."""
    import uvicorn

    from dflash_jax.serve.app import build_app
    from dflash_jax.serve.shutdown import DrainingServer

    app = build_app(engine, api_key=key, max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=args.shutdown_timeout)
    server = DrainingServer(config, engine, args.shutdown_timeout)
    engine.on_death = lambda _e: setattr(server, "should_exit", True)
    print(f"dflash-jax serve: {engine.model.name} ({why}) on http://{args.host}:{args.port}/v1, "
          f"{engine.layout.describe()}", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it stopped on once it is done; these handlers make that a no-op,
    # so a signal ends the command with 0 rather than the signal's default action
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if engine.error is not None:
        print(f"error: the engine died: {type(engine.error).__name__}: {engine.error}", file=sys.stderr, flush=True)
        return 1
    return 0
