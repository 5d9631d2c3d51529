"""Which batch sizes of the server's decoding set-up are ready (compiled and, under ``n_max="auto"``,
with their step costs), and how one more is made ready.

A size is ready once its programs ran once (:meth:`Batch.warm_up
<dflash_jax.serve.batch.Batch.warm_up>`) and the batch jumped from it to every other ready size
and back (each jump is a program). The engine grows its batch only up to :meth:`WarmUp.ready_rows`,
so no request ever waits on a compile of the server's own set-up: the sizes named by ``--warm-up``
are made ready before the server listens, the rest by the engine thread while it is idle (or has
requests but no ready size), smallest first.
"""

from __future__ import annotations

from dflash_jax.errors import DFlashError


def parse_sizes(text: str) -> list[int] | None:
    """``--warm-up``'s value: ``"all"`` (``None``), ``"none"`` (``[]``) or batch sizes ``"1,2,4"``
    (DFlashError naming the option otherwise)."""
    if text == "all":
        return None
    if text == "none":
        return []
    try:
        sizes = sorted({int(x) for x in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise DFlashError("--warm-up", f"got {text!r}", "'all', 'none' or batch sizes such as 1,2,4")
    return sizes


class WarmUp:
    """The ready sizes among ``sizes`` (the engine's batch sizes, ascending)."""

    def __init__(self, sizes: list[int]):
        self.sizes, self.ready = list(sizes), []

    def check(self, wanted: list[int] | None) -> list[int]:
        """``wanted`` (``None``: every size), each one of :attr:`sizes` (DFlashError naming
        ``--warm-up`` otherwise)."""
        if wanted is None:
            return list(self.sizes)
        bad = [s for s in wanted if s not in self.sizes]
        if bad:
            raise DFlashError("--warm-up", f"batch size {bad[0]} is not one this server runs", f"some of {self.sizes} (--max-batch)")
        return sorted(wanted)

    def ready_rows(self) -> int:
        """The most rows the batch may hold: the largest size whose smaller sizes are all ready too
        (0: none is)."""
        top = 0
        for s in self.sizes:
            if s not in self.ready:
                break
            top = s
        return top

    def cold(self) -> list[int]:
        """The sizes not ready yet, smallest first."""
        return [s for s in self.sizes if s not in self.ready]

    def make_ready(self, batch, rows: int) -> None:
        """Runs ``batch`` (idle, of the server's set-up) at ``rows`` rows and jumps between it and
        every ready size; the batch ends at the smallest ready size."""
        batch.resize(rows, [])
        batch.warm_up()
        for other in self.ready:
            batch.resize(other, [])
            batch.resize(rows, [])
        self.ready.append(rows)
        batch.resize(min(self.ready), [])
