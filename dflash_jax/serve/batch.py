"""The device side of the serving engine: ``B`` rows decoded together under one
:class:`~dflash_jax.decode.state.Decoding`, new prompts prefilled in chunks and swapped into free rows.
Each row keeps its request's sampling settings, seed, stop ids and budget in the state, so any
mix of requests shares the batch and its compiled steps.

Everything here is a call of the public decode functions: :func:`dflash_jax.decode.loop.init_state`,
:func:`~dflash_jax.decode.loop.prefill_chunk` / :func:`~dflash_jax.decode.loop.finish_prefill` (one chunk per
engine round, so a long prompt does not stall the running rows), :func:`~dflash_jax.decode.loop.replace_rows`
and :func:`~dflash_jax.decode.loop.generate_until` with a step bound (a few steps on device per host
round trip). A free row is a done row (its finish code is not ``RUNNING``) of length 1: done rows
never change, so they cost compute but never alter the others, and at length 1 they add nothing
to the attention span.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode import loop as decode
from dflash_jax.decode.auto import history
from dflash_jax.runtime import sharding
from dflash_jax.arguments import effective_chunk_size
from dflash_jax.runtime.carry import flat_axes
from dflash_jax.runtime.carry import PagedKVCache
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.runtime.distributed import fetch
from dflash_jax.errors import DFlashError
from dflash_jax.driver import spec_stats
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.serve import pages as paging
from dflash_jax.serve import prefix_cache
from dflash_jax.decode.state import STOP, DecodeState


@functools.partial(jax.jit, donate_argnames=("state",))
def release_rows(state: DecodeState, rows_mask) -> DecodeState:
    """Frees the rows of ``rows_mask`` (``[B]`` bool): ends those still running (finish code
    ``STOP``) and sets their length to 1. Attention reads the cache up to the longest row of the
    batch, done or not (:func:`~dflash_jax.nn.attention.live_keys`), so a free row that kept
    a long answer's length would make every step of the others read that far. In a paged batch
    their page tables go back to the trash page (:func:`~dflash_jax.serve.pages.clear_tables`)."""
    if isinstance(state.cache, PagedKVCache):  # other families' caches (rings, recurrent states) are never paged
        state = paging.clear_tables(state, rows_mask)
    return state.replace(finish=jnp.where(rows_mask & ~state.done, STOP, state.finish), length=jnp.where(rows_mask, 1, state.length))


@jax.jit
def take_rows(state: DecodeState, rows) -> DecodeState:
    """A state of the rows ``rows`` (``[R]`` int32) of ``state``: every array with a ``"batch"``
    axis gathered along it, the rest (stop ids, key, step counter) kept."""
    leaves, tdef = jax.tree_util.tree_flatten(state)
    out = [x if "batch" not in ax else jnp.take(x, rows, axis=ax.index("batch")) for x, ax in zip(leaves, flat_axes(state))]
    return jax.tree_util.tree_unflatten(tdef, out)


def bucket(n: int) -> int:
    """The smallest power of two >= ``n`` (batch sizes come in few shapes: few compiles)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class Prefill:
    """A group of prompts being prefilled (one chunk per engine round) before joining the batch.

    Attributes:
      rows: the batch rows they will take.
      state: their own fresh state (``R`` rows); ``acc`` the last-prompt-row logits so far.
      start: the next chunk's first position; ``end``: the longest prompt; ``chunk``: chunk size.
      prompts: the prompts; ``cached``: the leading tokens of each that came from the prefix cache.
    """

    rows: list[int]
    state: DecodeState
    acc: jax.Array
    start: int
    end: int
    chunk: int
    prompts: list[list[int]]
    cached: int = 0

    @property
    def complete(self) -> bool:
        return self.start >= self.end


class Batch:
    """``rows`` decode rows of capacity ``max_len`` under ``static``, all free at first.

    Args:
      params: the weights (:class:`~dflash_jax.decode.state.Params`).
      static: the decoding set-up every row shares.
      rows: the batch size (``--max-batch``).
      max_len: tokens per row, prompt included (``--max-len``).
      stop_width: the most stop ids a row holds (EOS and a request's single-token stop texts).
      chunk_size: prompt tokens per prefill pass (capped per group by the longest prompt).
      depth_params: under ``n_max="auto"``,
        :meth:`~dflash_jax.serve.jobs.ServedModel.depth_params` (the step's depth policy).
      prefix: a :class:`~dflash_jax.serve.prefix_cache.PrefixCache` that prompts are restored
        from and kept in, or ``None`` (also when the target's cache does not support it).
      mesh: the target's :class:`jax.sharding.Mesh` (every state is laid out on it), or ``None``.
      kv_pages: a paged batch (:mod:`~dflash_jax.serve.pages`) of this many pages (trash page
        included) shared by its rows; ``None``: every row owns ``max_len`` slots.
    """

    def __init__(self, params: Params, static: Decoding, rows: int, max_len: int, stop_width: int, chunk_size: int, depth_params=None,
                 prefix=None, mesh=None, kv_pages: int | None = None):
        self.params, self.static, self.rows, self.max_len, self.chunk_size = params, static, rows, max_len, chunk_size
        self.stop_width, self.mesh = max(1, stop_width), mesh
        self.pool = None if kv_pages is None else paging.PagePool(kv_pages, paging.PAGE_SIZE, max_len)
        self.state = self._empty(rows) if kv_pages is None else self._placed(self._free_all(paging.paged(self._fresh([[0]] * rows, 1), kv_pages)))
        self.prefix = prefix if prefix is not None and (self.pool is not None or prefix_cache.supports(self.state)) else None
        self._depth_params, self._step_params = depth_params, {}

    def _empty(self, rows: int) -> DecodeState:
        return self._free_all(self._placed(self._fresh([[0]] * rows, None)))

    def _fresh(self, prompts, cache_len, max_new=1, stop_ids=None, seeds=0, sampling=None) -> DecodeState:
        n = len(prompts)
        return decode.init_state(self.static, prompts, self.max_len, max_new, self._stops(stop_ids or [()] * n), seeds,
                                 sampling or [SamplingConfig()] * n, cache_len=cache_len)

    @staticmethod
    def _free_all(state: DecodeState) -> DecodeState:
        return release_rows(state, jnp.ones((state.tokens.shape[0],), bool))

    def _placed(self, state: DecodeState) -> DecodeState:
        """``state`` laid out on the mesh (rows over ``"data"``), if there is one."""
        return state if self.mesh is None else sharding.shard_state(state, self.mesh)

    def resize(self, rows: int, keep: list[int]) -> None:
        """Makes the batch ``rows`` rows, keeping the rows ``keep`` (as rows ``0..len(keep)-1``
        when shrinking; at their own index when growing). Idle rows cost a full share of every
        step's compute, so the batch holds only as many rows as its requests need (rounded up to
        a power of two)."""
        if rows == self.rows:
            return
        if self.pool is not None:  # the pools stay; the tables move with their rows
            order = list(keep) if rows < self.rows else list(range(self.rows))
            extra = rows - len(order)
            state = take_rows(self.state, jnp.asarray(order + [order[0] if order else 0] * extra, jnp.int32))
            self.state, self.rows = release_rows(state, jnp.asarray([False] * len(order) + [True] * extra)), rows
            self.pool.moved(order)
            return
        if rows > self.rows:  # grow: the old rows keep their indices
            state = decode.replace_rows(self._empty(rows), self.state, jnp.arange(self.rows, dtype=jnp.int32))
        else:  # shrink: the kept rows first, then copies of a free (done) row
            free = next(i for i in range(self.rows) if i not in keep)
            state = take_rows(self.state, jnp.asarray(list(keep) + [free] * (rows - len(keep)), jnp.int32))
        self.state, self.rows = state, rows

    def _stops(self, stop_ids: list) -> list[list[int]]:
        """Each row's stop ids padded with ``-1`` to :attr:`stop_width` (one shape: one program)."""
        if any(len(s) > self.stop_width for s in stop_ids):
            raise DFlashError("stop", f"{max(map(len, stop_ids))} stop ids for one row", f"at most {self.stop_width}")
        return [list(s) + [-1] * (self.stop_width - len(s)) for s in stop_ids]

    def start_prefill(self, rows: list[int], prompts: list[list[int]], max_new: list[int], seeds: list[int],
                      stop_ids: list | None = None, sampling: list[SamplingConfig] | None = None, reserve: list[int] | None = None) -> Prefill:
        """A :class:`Prefill` of ``prompts`` for ``rows``, each prompt with its own budget, seed,
        stop ids (default none) and sampling settings (default greedy) wherever it lands
        (raises DFlashError for a bad prompt). The prefix cache's blocks that every prompt of the
        group starts with are copied in, and the prefill starts after them. In a paged batch each
        row takes the pages of its prompt, or of its ``reserve`` positions when more (the engine
        reserves a row's first decode round while it prefills)."""
        cache_len = None if self.pool is None else paging.prefill_len(max(len(p) for p in prompts), self.max_len)
        fresh = self._placed(self._fresh(prompts, cache_len, max_new, stop_ids, list(seeds), sampling))
        start = min(self.prefix.cached(p) for p in prompts) if self.prefix is not None else 0
        if start:
            fresh = self.prefix.restore(fresh, prompts, start)
        if self.pool is not None:  # the pages of the prompts (or of ``reserve``); the decode rounds' come with :meth:`grow`
            for r, prompt, n in zip(rows, prompts, reserve or [0] * len(rows)):
                self.pool.grow(r, max(len(prompt), n))
        end = max(len(p) for p in prompts)
        acc = jnp.zeros((len(prompts), self.static.target.vocab_size), jnp.float32)
        return Prefill(rows=list(rows), state=fresh, acc=acc, start=start, end=end, chunk=effective_chunk_size(self.chunk_size, end - start),
                       prompts=[list(p) for p in prompts], cached=start)

    def prefill_step(self, p: Prefill) -> None:
        """Runs the next chunk of ``p``; when it was the last, samples the first tokens and swaps
        the group into its rows (``p.complete`` then)."""
        p.state, p.acc = decode.prefill_chunk(self.params, p.state, self.static, p.acc, jnp.int32(p.start), p.chunk)
        p.start += p.chunk
        if self.prefix is not None:
            self.prefix.keep(p.state, p.prompts, p.start)
        if not p.complete:
            return
        fresh = decode.finish_prefill(p.state, self.static, p.acc)
        if self.static.adaptive:  # the new rows start from the batch's online acceptance
            fresh = history.joining(self.state, fresh)
        rows = jnp.asarray(p.rows, jnp.int32)
        if self.pool is None:
            self.state = decode.replace_rows(self.state, fresh, rows)
        else:
            self.state = paging.adopt_rows(self.state, fresh, rows, jnp.asarray([self.pool.table(r) for r in p.rows], jnp.int32))

    def warm_up(self) -> None:
        """Runs this batch size's programs once on throwaway rows, so that no request compiles
        them: for each group size a request group can take here (powers of two up to the batch
        size), a prefill of one-token prompts (the smallest prefill chunk) with the prefix cache's
        block copies, the swap into the batch and a decode round (under ``n_max="auto"`` after this size's step costs); the rows
        are freed after. Call it on an idle batch."""
        g = 1
        while g <= self.rows:
            p = self.start_prefill(list(range(g)), [[0]] * g, [1] * g, [0] * g)
            if self.prefix is not None:  # the block copies of this group size (a block written back as it was)
                p.state = prefix_cache.put_block(p.state, jnp.int32(0), jnp.int32(0), prefix_cache.take_block(p.state, jnp.int32(0), jnp.int32(0)))
            while not p.complete:
                self.prefill_step(p)
            if self.pool is not None:  # the table update of a decode round
                self._set_tables(list(range(g)))
            self.run(self.rows, 1)
            self.release(list(range(self.rows)))
            g *= 2

    def run(self, min_done: int, max_steps: int) -> None:
        """Decodes on device until ``min_done`` rows are done, all are, or ``max_steps`` steps ran."""
        self.state = decode.generate_until(self.params_for_steps(), self.state, self.static, jnp.int32(min_done), jnp.int32(max_steps))

    def params_for_steps(self) -> Params:
        """The weights of a decode step: under ``n_max="auto"`` with the depth policy of this batch
        size (``depth_params(params, static, state, run)``, once per size)."""
        if not self.static.adaptive:
            return self.params
        if self.rows not in self._step_params:
            rows = jnp.int32(self.rows)

            def run(p, s):
                return decode.generate_until(p, s, self.static, rows, jnp.int32(self.max_len))

            self._step_params[self.rows] = self._depth_params(self.params, self.static, self.state, run)
        return self._step_params[self.rows]

    def read(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens [B, S], length [B], finish [B])`` on the host."""
        return fetch((self.state.tokens, self.state.length, self.state.finish))

    def read_logprobs(self):
        """The host copy of the state's :class:`~dflash_jax.decode.logprobs.TokenLogprobs` (``None``
        when this set-up records none)."""
        return None if self.state.logprobs is None else fetch(self.state.logprobs)

    def grow(self, want: dict[int, int]) -> None:
        """In a paged batch, gives each row of ``want`` the pages of its positions ``[0, want[row])``
        (:meth:`~dflash_jax.serve.pages.PagePool.grow`; the caller checked they are free) and
        points its table at them."""
        changed = [r for r, n in sorted(want.items()) if self.pool.grow(r, n)]
        if changed:
            self._set_tables(changed)

    def _set_tables(self, rows: list[int]) -> None:
        """Copies the ledger's tables of ``rows`` to the device (one program per batch size)."""
        mask = np.zeros((self.rows,), bool)
        mask[rows] = True
        table = [self.pool.table(r) for r in range(self.rows)]
        self.state = paging.set_tables(self.state, jnp.asarray(table, jnp.int32), jnp.asarray(mask))

    def release(self, rows: list[int]) -> None:
        """Frees ``rows`` (finished, stopped on the host or cancelled): see :func:`release_rows`."""
        mask = np.zeros((self.rows,), bool)
        mask[rows] = True
        self.state = release_rows(self.state, jnp.asarray(mask))
        if self.pool is not None:
            for r in rows:
                self.pool.give(r)

    def row_stats(self, row: int) -> dict | None:
        """The speculative statistics of one row and the batch's tree (``None`` under plain
        decoding); ``n_max`` is ``"auto"`` under the adaptive depth, else the drafted depth."""
        if not self.static.speculative:
            return None
        return dict(spec_stats(self.state, [row], n_max="auto" if self.static.adaptive else None), tree=self.static.tree)
