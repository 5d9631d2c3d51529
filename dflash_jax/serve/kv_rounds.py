"""The engine's rounds in a paged batch (:mod:`~dflash_jax.serve.pages`): the pages a queued request
needs for its first round, those the running rows need for their next one, and preemption when the
pool lacks them. A mixin of :class:`~dflash_jax.serve.engine.Engine` (its state: ``_batch``,
``_rows``, ``_queue``, ``_static``, ``steps_per_round``, ``max_len``, ``metrics``)."""

from __future__ import annotations

from dflash_jax.serve.jobs import Job
from dflash_jax.serve.running import RunningRequest


class KVRounds:
    """Page bookkeeping of the engine's decode rounds (module docstring)."""

    def _first_round(self, job: Job) -> int:
        """Positions a queued request holds once prefilled and through its first decode round."""
        return min(len(RunningRequest.prompt(job)) + 1 + self._reach(), self.max_len)

    def _first_rounds(self, jobs: list[Job]) -> int:
        """How many of ``jobs``, in order, have their first round's pages free beside the running
        rows' next round (:meth:`~dflash_jax.serve.pages.PagePool.fits`)."""
        pool = self._batch.pool
        return pool.fits([pool.pages(self._first_round(j)) for j in jobs], keep=pool.short(self._next_round()))

    def _reach(self) -> int:
        """Positions past its committed length a row may write in one round of decode steps."""
        return self.steps_per_round * self._static.width + self._static.verify_top

    def _next_round(self) -> dict[int, int]:
        """Row -> the positions each running row must hold for the next round."""
        reach = self._reach()
        return {r.row: min(r.seen + reach, r.limit(self.max_len, self._static.verify_top + 1)) for r in self._rows if r is not None}

    def _make_room(self) -> None:
        """In a paged batch, gives the running rows their next round's pages, first preempting the
        rows admitted last while the pool lacks them (:mod:`~dflash_jax.serve.pages`)."""
        pool = self._batch.pool
        if pool is None:
            return
        want = self._next_round()
        while pool.short(want) > pool.free:
            self._preempt(max((r for r in self._rows if r is not None), key=lambda r: r.order))
            want = self._next_round()
        self._batch.grow(want)
        self._gauges()

    def _preempt(self, r: RunningRequest) -> None:
        """Frees ``r``'s row and pages and puts its request back at the head of the queue, with what
        it generated so far (it resumes as prompt + those tokens: the same positions, the same
        seeded draws)."""
        self._batch.release([r.row])
        self._rows[r.row] = None
        r.job.resumed = r
        with self._cv:
            self._queue.appendleft(r.job)
        if self.metrics is not None:
            self.metrics.preemptions.inc()
