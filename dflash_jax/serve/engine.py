"""The serving engine: one thread owns the device batch and runs continuous batching.

Each round the thread (1) drops cancelled requests, freeing their rows; (2) advances admission:
queued requests are prefilled one chunk per round and swapped into free rows
(:class:`~dflash_jax.serve.batch.Batch`), each row with its own sampling settings, seed, stop
ids and budget (greedy and sampled requests share the batch and its compiled steps); (3) runs up
to ``steps_per_round`` decode steps on device (fewer when a row finishes) and hands every request
its new text. Only a request that asks its own draft depth (``n_max``, an extension for
experiments) runs under another :class:`~dflash_jax.decode.state.Decoding`: it waits until the batch
drains, then the batch switches to it (one compile per set-up, cached after).

A request whose client disconnects is flagged at once (a stream's disconnect, or a task that waits
for it under a whole answer) and its row is freed at the end of the round in progress: at most
``steps_per_round`` decode steps later (rounds also end as soon as a row finishes). One step
exactly would need a host round trip per step (``--steps-per-round 1``: on the default pair on a
2-core CPU, 1-9 % more CPU per token than one on-device loop, against 0-5 % in rounds of 4;
BENCHMARKS.md, serving) or a host callback between steps (about 0.1 ms a step, but JAX
keeps no program with a host callback in its persistent compilation cache, so every restart would
recompile the decode programs); the bound is one round instead.

A failure while handling one request fails only that request;
an exception outside that (a device error) ends the engine: every request gets an error,
:attr:`Engine.error` is set and ``on_death`` is called (the command line then exits non-zero).
"""

from __future__ import annotations

import collections
import threading
import time
import traceback

import numpy as np

from dflash_jax import progress
from dflash_jax.errors import DFlashError
from dflash_jax.serve.batch import Batch, Prefill, bucket
from dflash_jax.serve.follow import Mirrored
from dflash_jax.serve.kv_rounds import KVRounds
from dflash_jax.serve.logprobs import entries
from dflash_jax.serve.jobs import MAX_STOPS, Done, Failed, Job, ServedModel, Text
from dflash_jax.serve.pages import kv_layout
from dflash_jax.serve.prefix_cache import PrefixCache
from dflash_jax.serve.running import RunningRequest
from dflash_jax.serve.warmup import WarmUp
from dflash_jax.decode.state import FINISH_REASONS, RUNNING
from dflash_jax.text import cut_at_stop_text


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests already."""


class NoFreePages(QueueFull):
    """The queue is full and what holds it up is the paged KV pool: no pages for the next request."""


class NotAccepting(Exception):
    """The engine is stopping or dead."""


class Engine(KVRounds):
    """Continuous batching over ``max_batch`` rows (module docstring).

    Args:
      model: the :class:`~dflash_jax.serve.jobs.ServedModel`.
      max_batch: rows decoded together; max_len: tokens per row; max_queue: waiting requests
        beyond which :meth:`submit` refuses; chunk_size: prompt tokens per prefill pass;
        steps_per_round: decode steps on device per host round trip.
      prefix_cache_bytes: the prefix cache's budget (:mod:`~dflash_jax.serve.prefix_cache`; 0: off).
      kv_cache_bytes: the budget of the target K/V and drafter context (``None``: ``max_batch`` rows
        of ``max_len`` tokens); paged: a batch of paged KV (:mod:`~dflash_jax.serve.pages`) where
        the target's family supports it, the pool sized by that budget and the rows by
        ``max_batch`` (else every row owns ``max_len`` slots and the budget caps the rows).
      metrics: a :class:`~dflash_jax.serve.metrics.Metrics` or ``None``.
      on_death: called (from the engine thread) with the exception that ended the engine.
      channel: with several processes, process 0's :class:`~dflash_jax.runtime.distributed.Broadcast` to
        the followers (:mod:`~dflash_jax.serve.follow`): the batch's device calls are sent on it.
      warm_sizes: the batch sizes :meth:`warm_up` makes ready (``None``: all; ``--warm-up``); the
        rest are made ready by the engine thread before the batch grows to them (:mod:`~dflash_jax.serve.warmup`).
    """

    def __init__(self, model: ServedModel, max_batch: int = 16, max_len: int = 1024, max_queue: int = 256,
                 chunk_size: int = 256, steps_per_round: int = 4, metrics=None, on_death=None, prefix_cache_bytes: int = 1 << 30,
                 channel=None, kv_cache_bytes: int | None = None, paged: bool = True, warm_sizes: list[int] | None = None):
        self.model, self.max_len, self.max_queue = model, max_len, max_queue
        self.layout = kv_layout(model.decoding(), max_batch, max_len, kv_cache_bytes, paged, model.target.mesh)
        self.max_batch = self.layout.rows
        self.chunk_size, self.steps_per_round, self.metrics, self.on_death = chunk_size, steps_per_round, metrics, on_death
        self.tokenizer, self.channel = model.target.tokenizer, channel
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._rows: list[RunningRequest | None] = []  # one per batch row; the batch grows up to max_batch
        self._reserved: set[int] = set()
        self._batch: Batch | None = None
        self._static = None  # the running batch's Decoding
        self._prefill: tuple[Prefill, list[Job]] | None = None
        self._stopping = False
        self._deadline: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="dflash-engine", daemon=True)
        self._warm = WarmUp(self.batch_sizes())
        self.warm_sizes = self._warm.check(warm_sizes)

    # ------------------------------------------------------------------ control (any thread)

    def start(self) -> None:
        """Starts the engine thread."""
        self._thread.start()

    @property
    def started(self) -> bool:
        """Whether :meth:`start` was called (the thread may have ended since)."""
        return self._thread.ident is not None

    def batch_sizes(self) -> list[int]:
        """The batch sizes the engine can run: powers of two below ``max_batch``, and ``max_batch``."""
        return sorted({min(self.max_batch, bucket(n)) for n in range(1, self.max_batch + 1)})

    def warm_up(self) -> None:
        """Gets the batch sizes of :attr:`warm_sizes` (default every size of :meth:`batch_sizes`)
        ready before the server listens (call it before :meth:`start`): runs the server's programs
        (its draft depth) once at each (:meth:`Batch.warm_up <dflash_jax.serve.batch.Batch.warm_up>`)
        and resizes the batch from each size to each other, so requests compile nothing (greedy or
        sampled: the settings are the rows') and, under ``n_max="auto"``, the step costs of each
        size are read from ``depth_costs/`` or measured now. The other sizes are made ready by the
        engine thread while idle, before the batch grows to them. Prompts longer than the smallest
        prefill chunk, and a request's own ``n_max`` or log-probabilities, compile their programs
        when they first come."""
        static = self.model.decoding()
        what = "compiling" + (" and measuring the step costs" if static.adaptive else "")
        self._switch(static)
        if self.warm_sizes:
            with progress.step(f"{what} for batch sizes {', '.join(map(str, self.warm_sizes))}", "those batch sizes are ready"):
                for rows in self.warm_sizes:
                    self._warm.make_ready(self._batch, rows)
        self._rows = [None] * self._batch.rows

    def _warm_next(self) -> bool:
        """Makes the next cold batch size ready when the batch is idle under the server's set-up and
        no request could be admitted now; ``True`` when it did (:mod:`~dflash_jax.serve.warmup`)."""
        cold = self._warm.cold()
        if not cold or self._prefill is not None or any(r is not None for r in self._rows) or self._static != self.model.decoding():
            return False
        if self._queue and self._warm.ready_rows() > 0:
            return False  # requests first: they run at the ready sizes
        self._warm.make_ready(self._batch, cold[0])
        self._rows = [None] * self._batch.rows
        return True

    def submit(self, job: Job) -> None:
        """Queues ``job``. Raises :class:`QueueFull` or :class:`NotAccepting`."""
        with self._cv:
            if self.error is not None or self._stopping:
                raise NotAccepting("the engine is stopping" if self.error is None else f"the engine died: {self.error}")
            if len(self._queue) >= self.max_queue:
                pool = None if self._batch is None else self._batch.pool
                if pool is not None and self.counts()[0] < self.max_batch and self._first_rounds([self._queue[0]]) == 0:
                    raise NoFreePages(f"no free KV pages: {pool.free} of {pool.total} pages of {pool.page_size} tokens are free "
                                      f"(--kv-cache-mb) and {len(self._queue)} requests wait for them (--max-queue {self.max_queue})")
                raise QueueFull(f"{len(self._queue)} requests are waiting (--max-queue {self.max_queue})")
            self._queue.append(job)
            self._cv.notify()
        self._gauges()

    def wake(self) -> None:
        """Wakes the engine (a request was cancelled)."""
        with self._cv:
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops admitting, lets running requests finish for up to ``timeout`` seconds, cancels the
        rest (they get a 503 error) and joins the thread."""
        with self._cv:
            self._stopping = True
            self._deadline = time.monotonic() + timeout
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout + 60)

    @property
    def status(self) -> str:
        """``"starting"`` (not started, or no batch size ready), ``"ready"``, ``"draining"``
        (stopping) or ``"dead"``."""
        if self.error is not None:
            return "dead"
        if self._stopping:
            return "draining"
        return "ready" if self.started and self._warm.ready_rows() > 0 else "starting"

    def counts(self) -> tuple[int, int]:
        """``(running requests, waiting requests)``."""
        return sum(r is not None for r in self._rows) + len(self._reserved), len(self._queue)

    # ------------------------------------------------------------------ the thread

    def _main(self) -> None:
        try:
            while self._round():
                pass
        except BaseException as e:  # the engine itself failed: nobody is served any more
            self.error = e
            traceback.print_exception(type(e), e, e.__traceback__)
            self._fail_everyone(Failed(f"the engine died: {type(e).__name__}: {e}", 500))
            if self.metrics is not None:
                self.metrics.engine_alive.set(0)
            if self.on_death is not None:
                self.on_death(e)

    def _round(self) -> bool:
        """One engine round; returns ``False`` when the engine has stopped."""
        self._sweep()
        if self._stopping:  # requests preempted from a paged batch were running: they stay queued to finish
            self._drain_queue(Failed("the server is shutting down", 503), keep_resumed=True)
            active = any(r is not None for r in self._rows) or self._prefill is not None or bool(self._queue)
            if not active:
                return False
            if time.monotonic() > self._deadline:
                self._fail_everyone(Failed("the server is shutting down (cancelled after --shutdown-timeout)", 503))
                return False
        if self._warm_next():
            return True
        self._admit()
        if any(r is not None for r in self._rows):
            self._decode()
        elif self._prefill is None:
            with self._cv:
                if not self._queue and not self._stopping:
                    self._cv.wait(0.5)
        return True

    def _sweep(self) -> None:
        """Cancelled requests leave the queue; cancelled rows are ended and freed."""
        with self._cv:
            if any(j.cancelled for j in self._queue):
                self._queue = collections.deque(j for j in self._queue if not j.cancelled)
        gone = [r for r in self._rows if r is not None and r.job.cancelled]
        self._end([(r, self._done(r, "cancelled", stats=False)) for r in gone])

    def _admit(self) -> None:
        """Starts a prefill group, or runs the next chunk of the one in progress."""
        if self._prefill is None and (not self._stopping or self._queue):
            self._start_group()
        if self._prefill is not None:
            group, jobs = self._prefill
            self._batch.prefill_step(group)
            if self.metrics is not None and self.prefix is not None:
                self.metrics.prefix_bytes.set(self.prefix.bytes)
                self.metrics.prefix_blocks.set(len(self.prefix))
            if group.complete:
                self._prefill = None
                self._reserved.difference_update(group.rows)
                for job, row in zip(jobs, group.rows):
                    self._rows[row] = RunningRequest(job, row, self.tokenizer, group.cached)
                self._deliver(self._batch.read())

    def _start_group(self) -> None:
        """Takes the next requests of the running set-up (a power-of-two group, at most the rows
        left) off the queue and starts their prefill, growing the batch to hold them; switches
        set-ups (a request's own ``n_max``) when the batch is idle."""
        active = sum(r is not None for r in self._rows)
        with self._cv:
            if not self._queue:
                return
            head = self._queue[0].spec.static
            top = self._warm.ready_rows() if head == self.model.decoding() else self.max_batch  # never a cold size
            if active >= top:
                return
            if head != self._static:
                if active:
                    return  # the running set-up drains first
                self._switch(head)
            n = 0
            while n < min(top - active, len(self._queue)) and self._queue[n].spec.static == head:
                n += 1
            if self._batch.pool is not None:  # as many as have their first round's pages free beside the running rows' next round
                n = self._first_rounds(list(self._queue)[:n])
                if n == 0:
                    return
            n = 1 << (n.bit_length() - 1)  # few group sizes: few compiles
            jobs = [self._queue.popleft() for _ in range(n)]
        self._resize(min(top, bucket(active + n)))
        rows = [i for i, r in enumerate(self._rows) if r is None][:n]
        try:
            specs = [j.spec for j in jobs]
            eos = list(self.model.target.eos_ids)
            done = [len(RunningRequest.prompt(j)) - len(j.spec.prompt) for j in jobs]  # tokens generated before a preemption
            group = self._batch.start_prefill(rows, [RunningRequest.prompt(j) for j in jobs], [s.max_new - k for s, k in zip(specs, done)],
                                              [s.seed for s in specs],
                                              [([] if s.ignore_eos else eos) + list(s.stop_ids) for s in specs], [s.sampling for s in specs],
                                              [self._first_round(j) for j in jobs])
        except Exception as e:  # a request the checks let through: only these requests fail, the engine goes on
            traceback.print_exception(type(e), e, e.__traceback__)
            for j in jobs:
                j.post(Failed(str(e), 400) if isinstance(e, DFlashError) else Failed(f"{type(e).__name__}: {e}", 500))
            return
        self._reserved.update(rows)
        self._prefill = (group, jobs)
        if self.metrics is not None:
            self.metrics.prefix_hit_tokens.inc(group.cached * n)
        self._gauges()

    def _resize(self, rows: int) -> None:
        """Grows or shrinks the batch to ``rows`` rows (never while a prefill holds rows)."""
        if rows == self._batch.rows or self._prefill is not None:
            return
        running = [r for r in self._rows if r is not None]
        self._batch.resize(rows, [r.row for r in running])
        if rows > len(self._rows):
            self._rows = self._rows + [None] * (rows - len(self._rows))
        else:
            self._rows = running + [None] * (rows - len(running))
            for i, r in enumerate(running):
                r.row = i

    def _switch(self, static) -> None:
        """A fresh batch of one row under ``static`` (:meth:`new_batch`)."""
        self._batch = None  # free the old batch's buffers first
        if self.channel is not None:
            self.channel.send(("switch", (static,)))
        self._batch = self.new_batch(static)
        self._rows = [None]
        self._static = static

    def new_batch(self, static) -> Batch:
        """A batch of one free row under ``static``, with room for EOS and a request's stop ids per
        row (:class:`~dflash_jax.serve.follow.Mirrored` when the engine has a ``channel``)."""
        stop_width = len(self.model.target.eos_ids) + MAX_STOPS
        batch = Batch(self.model.params, static, 1, self.max_len, stop_width, self.chunk_size, self.model.depth_params, self.prefix,
                      self.model.target.mesh, self.layout.pages_for(static))
        return batch if self.channel is None else Mirrored(batch, self.channel)

    def _decode(self) -> None:
        """Up to ``steps_per_round`` steps on device (back early when one more row finishes)."""
        self._make_room()
        if not any(r is not None for r in self._rows):
            return
        done = sum(r is None for r in self._rows)
        self._batch.run(done + 1, self.steps_per_round)
        self._deliver(self._batch.read())
        active = sum(r is not None for r in self._rows)
        if active <= self._batch.rows // 2:
            self._resize(bucket(max(active, 1)))

    def _deliver(self, readback) -> None:
        """Hands every running request its new tokens; finishes and frees ended rows."""
        tokens, length, finish = readback
        lp = self._batch.read_logprobs() if self._static.logprobs is not None else None
        ended = []
        for r in [r for r in self._rows if r is not None]:
            try:
                if self._feed(r, tokens[r.row, r.seen : length[r.row]], entries(tokens, lp, r.row, r.seen, int(length[r.row]))):
                    ended.append((r, self._done(r, "stop")))
                elif finish[r.row] != RUNNING:
                    reason = FINISH_REASONS[int(finish[r.row])]
                    ended.append((r, self._done(r, "stop" if reason == "stop" else "length")))
                r.seen = int(length[r.row])
            except Exception as e:  # this request's failure is its own
                traceback.print_exception(type(e), e, e.__traceback__)
                ended.append((r, Failed(f"{type(e).__name__}: {e}", 500)))
        self._end(ended)

    def _feed(self, r: RunningRequest, new: np.ndarray, logprobs: list) -> bool:
        """Feeds ``new`` ids (and their log-probability entries, when recorded) to the request's text
        stream; ``True`` when a stop text ended it (a stop id ends the row on device, as EOS does)."""
        ids = [int(t) for t in new]
        if not ids:
            return False
        if r.job.first_token_at is None:
            r.job.first_token_at = time.perf_counter()
            if self.metrics is not None:
                self.metrics.ttft.observe(r.job.first_token_at - r.job.created)
        r.ids.extend(ids)
        text = r.stream.feed(ids)
        r.job.post(Text(text, len(ids), logprobs if r.job.spec.logprobs is not None else []))
        return r.stream.stopped

    def _done(self, r: RunningRequest, reason: str, stats: bool = True) -> Done:
        """Posts the request's last text; returns its :class:`~dflash_jax.serve.jobs.Done`
        (counted in the metrics; posted by :meth:`_end`)."""
        tail = r.stream.finish()
        if tail:
            r.job.post(Text(tail, 0))
        n = len(r.ids)
        if r.job.spec.stop_texts:
            cut = cut_at_stop_text(self.tokenizer, r.ids, r.job.spec.stop_texts)
            n = n if cut is None else cut
        spec = self._batch.row_stats(r.row) if stats else None
        done = Done(reason, len(r.job.spec.prompt), n, spec, r.cached)
        if self.metrics is not None:
            self.metrics.finished(r.job, done)
        return done

    def _end(self, ended: list[tuple[RunningRequest, object]]) -> None:
        """Frees the rows of ended requests (:meth:`Batch.release`), then posts each its last
        event: a client that has its answer finds its row free."""
        if not ended:
            return
        self._batch.release([r.row for r, _ in ended])
        for r, _ in ended:
            self._rows[r.row] = None
        self._gauges()
        for r, event in ended:
            r.job.post(event)

    def _drain_queue(self, event, keep_resumed: bool = False) -> None:
        """Posts ``event`` to every queued request and empties the queue (but for the preempted
        ones, with ``keep_resumed``)."""
        with self._cv:
            keep = collections.deque(j for j in self._queue if keep_resumed and j.resumed is not None)
            jobs, self._queue = [j for j in self._queue if j not in keep], keep
        for j in jobs:
            j.post(event)

    def _fail_everyone(self, event) -> None:
        self._drain_queue(event)
        if self._prefill is not None:
            for j in self._prefill[1]:
                j.post(event)
            self._prefill = None
        for r in [r for r in self._rows if r is not None]:
            r.job.post(event)
            self._rows[r.row] = None

    def _gauges(self) -> None:
        if self.metrics is not None:
            running, waiting = self.counts()
            self.metrics.running.set(running)
            self.metrics.waiting.set(waiting)
            pool = None if self._batch is None else self._batch.pool
            self.metrics.kv_pages_free.set(0 if pool is None else pool.free)
            self.metrics.kv_pages_total.set(0 if pool is None else pool.total)
