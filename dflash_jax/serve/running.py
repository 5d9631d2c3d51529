"""The engine's record of a running request (:mod:`dflash_jax.serve.engine`): its batch row, the ids
read back so far, its text stream, and what it prefills again when a paged batch preempts it
(:mod:`dflash_jax.serve.pages`)."""

from __future__ import annotations

import itertools

from dflash_jax.serve.jobs import Job
from dflash_jax.text import TextStream


class RunningRequest:
    """Engine-side bookkeeping of a running request: its row, ids read so far and text stream.
    A request preempted from a paged batch keeps its ``RunningRequest`` in ``job.resumed``: it comes back
    with the ids it had and its text stream where it was."""

    _admitted = itertools.count()

    def __init__(self, job: Job, row: int, tokenizer, cached: int = 0):
        before = job.resumed
        self.job, self.row, self.cached = job, row, cached if before is None else before.cached
        self.ids: list[int] = [] if before is None else before.ids
        self.stream = TextStream(tokenizer, job.spec.stop_texts, not job.spec.special_tokens) if before is None else before.stream
        self.seen = len(job.spec.prompt) + len(self.ids)
        self.order = next(self._admitted) if before is None else before.order  # a resumed request keeps its place
        job.resumed = None

    @staticmethod
    def prompt(job: Job) -> list[int]:
        """What the job prefills: its prompt, and what it generated before a preemption."""
        before = job.resumed
        return list(job.spec.prompt) + ([] if before is None else before.ids)

    def limit(self, max_len: int, reach: int) -> int:
        """Positions the row may write before it ends: its prompt, budget and a step's reach."""
        return min(len(self.job.spec.prompt) + self.job.spec.max_new + reach, max_len)
