"""A graceful stop for ``dflash-jax serve``: drain the engine first, then let uvicorn shut down.

uvicorn alone, on SIGTERM, closes its listening socket at once (a request sent during the grace
period is not answered) and sends the app's lifespan shutdown only after its grace period, so the
engine learns of the stop last and what is cancelled then ends with a traceback. Here the first
SIGTERM or SIGINT starts a drain instead (:meth:`DrainingServer.handle_exit`): the engine stops
admitting (waiting and new requests get 503 with ``Retry-After``, the server still listening),
running requests, streams included, get the grace period to finish
(:meth:`~dflash_jax.serve.engine.Engine.stop`), those that do not end with an error (a final SSE
error event when streamed); then uvicorn stops with nothing left running. A second signal during
the drain hands over to uvicorn at once (its own shutdown, open connections get its grace), and a
further SIGINT forces the exit.
"""

from __future__ import annotations

import sys
import threading

import uvicorn


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first exit signal drains ``engine`` for ``grace`` seconds (module
    docstring)."""

    def __init__(self, config: uvicorn.Config, engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain is None and not self.should_exit:
            self._captured_signals.append(sig)  # re-raised by uvicorn after its shutdown, as its own handler does
            self.drain = threading.Thread(target=self._drain, name="dflash-jax-drain", daemon=True)
            self.drain.start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        running, waiting = self.engine.counts()
        print(f"dflash-jax serve: stopping: {running} running requests get {self.grace:g} s to finish; {waiting} waiting and "
              "new ones get 503", file=sys.stderr, flush=True)
        self.engine.stop(self.grace)
        self.should_exit = True
