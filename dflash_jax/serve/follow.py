"""A server over several processes: process 0 listens and decides the schedule, the others follow.

Every device call of the engine's :class:`~dflash_jax.serve.batch.Batch` runs a program over the
global mesh (and reading rows back is a collective), so every process must make the same calls,
with the same arguments, in the same order. Process 0's engine runs as it does alone, but on a
:class:`Mirrored` batch: each such call is first sent on a
:class:`~dflash_jax.runtime.distributed.Broadcast`; every other process runs :func:`follow`, which makes
the same call on a batch of its own. The host's decisions (admission, which rows end, the prefix
cache's lookups and evictions) are made once, by process 0; a follower's prefix cache sees the
same calls and so holds the same blocks.

Start-up: every process runs the same command but ``--process-id``, and loads the model;
:func:`handshake` stops every process with an error when an option that decides the programs
differs. Stop: process 0's engine sends a last message when its thread ends (the drain of a
SIGTERM, or the engine's death), and each follower returns 0, or 1 when the engine died.
"""

from __future__ import annotations

import sys
import traceback

from dflash_jax.runtime import distributed
from dflash_jax.errors import DFlashError

CALLS = ("resize", "warm_up", "start_prefill", "prefill_step", "run", "read", "read_logprobs", "release", "row_stats", "grow")
"""The :class:`~dflash_jax.serve.batch.Batch` methods that touch the devices."""

PROCESS_ONLY = frozenset({"host", "port", "max_queue", "api_key", "api_key_file", "served_model_name", "shutdown_timeout",
                          "max_body_bytes", "debug", "process_id", "steps_per_round"})
"""``serve`` options that may differ between processes (process 0's decide, or only it uses them)."""


class Mirrored:
    """Process 0's batch: each call of :data:`CALLS` is sent to the followers, then made here;
    everything else is the wrapped batch's. ``prefill_step`` is sent without its group: a follower
    steps the group its own ``start_prefill`` returned (one prefill runs at a time)."""

    def __init__(self, batch, channel: distributed.Broadcast):
        self._batch, self._channel = batch, channel

    def __getattr__(self, name: str):
        value = getattr(self._batch, name)
        if name not in CALLS:
            return value

        def call(*args):
            self._channel.send((name, () if name == "prefill_step" else args))
            return value(*args)

        return call


def handshake(channel: distributed.Broadcast, args) -> None:
    """Checks that every process was started with process 0's options (but :data:`PROCESS_ONLY`);
    a collective, called by every process once the model is loaded.

    Raises:
      DFlashError: on the process whose option differs, naming it and both values; on the others,
        naming that process.
    """
    mine = {k: v for k, v in vars(args).items() if k not in PROCESS_ONLY}
    if distributed.is_leader():
        channel.send(("options", mine))
        differs = None
    else:
        _, theirs = channel.receive()
        differs = next((k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)), None)
    if not distributed.everywhere(differs is None):
        if differs is not None:
            option = "--" + differs.replace("_", "-")
            raise DFlashError(option, f"{mine.get(differs)!r} on process {args.process_id}, {theirs.get(differs)!r} on process 0",
                              "the same value on every process")
        raise DFlashError("--process-id", "another process was started with other options (its error names the option)",
                          "the same command on every process but --process-id")


def follow(engine, channel: distributed.Broadcast) -> int:
    """Runs process 0's batch calls on this process's batch (``engine.new_batch``) until process 0's
    engine stops; returns 0, or 1 when that engine died. A ``start_prefill`` that fails fails here
    as on process 0 (the same refused request), and the loop goes on.

    Raises:
      DFlashError: the group's coordination service failed.
    """
    print(f"dflash-jax serve: process {distributed.process_index()} follows process 0's schedule", file=sys.stderr, flush=True)
    batch = group = None
    while True:
        name, args = channel.receive()
        if name == "stop":
            return 0 if args[0] else 1
        if name == "switch":
            batch = None  # the old batch's buffers go first
            batch = engine.new_batch(*args)
            continue
        try:
            out = getattr(batch, name)(*((group,) if name == "prefill_step" else args))
        except Exception as e:
            if name != "start_prefill":
                raise
            traceback.print_exception(type(e), e, e.__traceback__)
            continue
        if name == "start_prefill":
            group = out
