"""Paged KV for the serving batch: memory that follows each row's tokens, not the capacity.

Without pages every row of a batch owns ``max_len`` slots of target K/V and drafter context, used
or not. With pages, the batch's target cache and drafter context are
:class:`~dflash_jax.runtime.carry.PagedKVCache` pools shared by all rows, and each row holds only the
pages of the positions it has reached: its prompt's when its prefill starts, then, before every
round of decode steps, as many as that round can write (:meth:`PagePool.grow`); all are given back
when it ends. The pool is sized by a byte budget, the rows by ``--max-batch``, so short requests
fit many more rows in the same memory, whatever ``max_tokens`` they ask.

When the running rows need more pages than are free, the engine preempts the row admitted last (as
vLLM does): its pages are freed and its request goes back to the head of the queue with what it
has generated, to be prefilled again as prompt + generated tokens and continue where it stopped
(:mod:`~dflash_jax.serve.engine`). The engine admits a request only when its first round's pages
are free beside the next round's pages of the running rows, so a preempted request waits rather
than thrashing.

Prompts are prefilled in a contiguous state of ``cache_len`` slots per row (the smallest power of
two, at least :data:`MIN_PREFILL_LEN`, that holds the longest prompt of the group), which is
copied into the rows' pages when the group joins the batch (:func:`adopt_rows`): the prefill
programs, the prefix cache and the chunking are those of an unpaged batch.

The host side (:class:`PagePool`) is plain Python and deterministic, so every process of a
multi-process server makes the same allocations from the same calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.runtime.carry import PAGE_SIZE, KVCache, PagedKVCache, init_kv_cache, init_paged_kv_cache
from dflash_jax.decode.loop import replace_rows
from dflash_jax.decode.state import Decoding
from dflash_jax.errors import DFlashError
from dflash_jax.families.registry import module_for
from dflash_jax.decode.state import DecodeState

MIN_PREFILL_LEN = 256
"""The smallest ``cache_len`` of a prefill group: prompts under 256 tokens (most chat turns) share
one prefill shape, the one the warm-up compiles."""


def row_bytes(static: Decoding, max_len: int) -> int:
    """Bytes of one unpaged row of ``max_len`` tokens: its target cache and drafter context (shapes
    only, nothing is allocated)."""
    cfg, d = static.target, static.drafter
    parts = [jax.eval_shape(lambda: module_for(cfg).init_cache(cfg, 1, max_len))]
    if d is not None:
        parts.append(jax.eval_shape(lambda: init_kv_cache(d.num_hidden_layers, 1, max_len, d.num_key_value_heads, d.head_dim, d.dtype)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(parts))


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """How a server holds its K/V: ``rows`` rows at most; ``budget`` bytes of target cache and
    drafter context; ``paged``: in a pool of pages (else ``max_len`` slots per row)."""

    rows: int
    budget: int
    paged: bool
    max_len: int

    def describe(self) -> str:
        """What the server holds, for its start-up line."""
        mib = f"{self.budget / 2**20:.0f} MiB of K/V"
        return f"up to {self.rows} rows of up to {self.max_len} tokens in {mib}" + (f", paged by {PAGE_SIZE} tokens" if self.paged else "")

    def pages_for(self, static: Decoding) -> int | None:
        """Pages of the pool of a batch under ``static`` (the trash page included), or ``None`` unpaged."""
        if not self.paged:
            return None
        return self.budget // (row_bytes(static, PAGE_SIZE)) + 1


def kv_layout(static: Decoding, max_batch: int, max_len: int, budget: int | None = None, paged: bool = True, mesh=None) -> KVLayout:
    """The layout of a server's K/V (``--max-batch``, ``--max-len``, ``--kv-cache-mb``, ``--kv-layout``).

    ``budget`` defaults to what ``max_batch`` unpaged rows of ``max_len`` tokens hold. Pages are
    used when asked for, the target's family supports them
    (:attr:`~dflash_jax.families.contract.FamilyModel.paged_kv`) and the target is on one device (a pool is
    not split by rows, and paged attention on a mesh is not tested yet); otherwise the budget caps
    the rows.

    Paged, the rows are at most the pool's pages (each row holds a page at least).

    Raises:
      DFlashError: a budget too small for one row of ``max_len`` tokens (``--kv-cache-mb``; paged,
        ``max_len`` rounded up to whole pages).
    """
    paged = paged and module_for(static.target).paged_kv and mesh is None
    per_row = row_bytes(static, -(-max_len // PAGE_SIZE) * PAGE_SIZE if paged else max_len)
    budget = max_batch * per_row if budget is None else int(budget)
    if budget < per_row:
        raise DFlashError("--kv-cache-mb", f"{budget / 2**20:.1f} MiB", f"at least {per_row / 2**20:.1f} MiB: one request of --max-len {max_len} "
                          "tokens (its target K/V and drafter context) must fit")
    layout = KVLayout(rows=max_batch, budget=budget, paged=paged, max_len=max_len)
    rows = min(max_batch, layout.pages_for(static) - 1) if paged else min(max_batch, budget // per_row)
    return dataclasses.replace(layout, rows=rows)


def prefill_len(longest: int, max_len: int) -> int:
    """``cache_len`` of a prefill group whose longest prompt has ``longest`` tokens (room for the
    first new token included), at most ``max_len``."""
    return min(max_len, max(MIN_PREFILL_LEN, 1 << longest.bit_length()))


class PagePool:
    """The host's ledger of a paged batch's pool: which pages each row holds.

    Args:
      pages: pages in the pool, the trash page 0 included (never handed out).
      page_size: positions per page.
      max_len: a row's capacity in tokens.
    Raises:
      DFlashError: a pool too small for one row of ``max_len`` tokens (``--kv-cache-mb``).
    """

    def __init__(self, pages: int, page_size: int, max_len: int):
        self.page_size, self.max_len = page_size, max_len
        self.per_row = -(-max_len // page_size)
        if pages - 1 < self.per_row:
            raise DFlashError("--kv-cache-mb", f"a pool of {pages - 1} pages of {page_size} tokens",
                              f"at least {self.per_row} pages: one request of --max-len {max_len} tokens must fit")
        self._free = list(range(pages - 1, 0, -1))  # pop() hands out the lowest id first
        self.held: dict[int, list[int]] = {}
        self.total = pages - 1

    @property
    def free(self) -> int:
        """Pages not held by any row."""
        return len(self._free)

    def pages(self, positions: int) -> int:
        """Pages that hold positions ``[0, positions)`` (at most a whole row's)."""
        return min(self.per_row, -(-positions // self.page_size))

    def short(self, want: dict[int, int]) -> int:
        """Pages the rows of ``want`` (row -> positions it must hold) lack, together."""
        return sum(max(0, self.pages(n) - len(self.held.get(r, ()))) for r, n in want.items())

    def fits(self, needs: list[int], keep: int = 0) -> int:
        """How many of the requests of ``needs`` pages, in order, fit in the free pages now,
        ``keep`` pages left aside."""
        n, left = 0, self.free - keep
        while n < len(needs) and needs[n] <= left:
            left -= needs[n]
            n += 1
        return n

    def grow(self, row: int, positions: int) -> bool:
        """Gives ``row`` the pages to hold positions ``[0, positions)``; whether it holds more now
        (raises RuntimeError when the pool lacks them: callers check :meth:`short` first)."""
        have = self.held.setdefault(row, [])
        extra = self.pages(positions) - len(have)
        if extra > self.free:  # an internal invariant, not bad input: the engine admits, grows and
            # preempts rows only after checking the free pages (Engine._make_room, Engine._first_rounds),
            # and a pool too small for one whole row is refused at start (DFlashError "--kv-cache-mb")
            raise RuntimeError(f"row {row} needs {extra} pages, {self.free} are free")
        have.extend(self._free.pop() for _ in range(max(0, extra)))
        return extra > 0

    def table(self, row: int) -> list[int]:
        """``row``'s table: its pages, then the trash page 0 (``per_row`` entries)."""
        have = self.held.get(row, [])
        return have + [0] * (self.per_row - len(have))

    def give(self, row: int) -> None:
        """Takes back ``row``'s pages (none held: nothing happens)."""
        self._free.extend(reversed(self.held.pop(row, [])))

    def moved(self, order: list[int]) -> None:
        """The batch's rows were reordered: new row ``i`` is old row ``order[i]``."""
        self.held = {i: self.held[r] for i, r in enumerate(order) if r in self.held}


def paged(state: DecodeState, pages: int, page_size: int = PAGE_SIZE) -> DecodeState:
    """``state`` (contiguous caches of any length) with its target cache and drafter context
    replaced by empty pools of ``pages`` pages and tables of ``state.capacity`` positions per row
    (rounded up to whole pages), every row on the trash page."""
    rows, capacity = state.tokens.shape[0], -(-state.capacity // page_size) * page_size

    def pool(c: KVCache) -> PagedKVCache:
        return init_paged_kv_cache(c.k.shape[0], rows, capacity, pages, c.k.shape[3], c.k.shape[4], c.k.dtype, page_size)

    spec = state.speculative
    return state.replace(cache=pool(state.cache), speculative=None if spec is None else spec.replace(context=pool(spec.context)))


def _with_tables(state: DecodeState, table: jnp.ndarray) -> DecodeState:
    spec = state.speculative
    return state.replace(cache=state.cache.replace(table=table),
                         speculative=None if spec is None else spec.replace(context=spec.context.replace(table=table)))


@functools.partial(jax.jit, donate_argnames=("state",))
def set_tables(state: DecodeState, table: jnp.ndarray, rows_mask: jnp.ndarray) -> DecodeState:
    """``state`` (donated) with the page tables of the rows of ``rows_mask [B]`` set to those of
    ``table [B, n]`` (int32), the other rows' kept."""
    return _with_tables(state, jnp.where(rows_mask[:, None], table, state.cache.table))


def clear_tables(state: DecodeState, rows_mask: jnp.ndarray) -> DecodeState:
    """``state`` with the page tables of the rows of ``rows_mask [B]`` back on the trash page (their
    writes can no longer reach pages handed to other rows)."""
    return _with_tables(state, jnp.where(rows_mask[:, None], 0, state.cache.table))


@functools.partial(jax.jit, donate_argnames=("state",))
def adopt_rows(state: DecodeState, fresh: DecodeState, rows: jnp.ndarray, tables: jnp.ndarray) -> DecodeState:
    """A paged ``state`` (donated) with its rows ``rows [R]`` replaced by the prefilled rows of
    ``fresh`` (contiguous caches of ``cache_len`` slots): the rows take the page tables ``tables
    [R, n]`` and ``fresh``'s K/V and drafter context are written into those pages; every other
    per-row array is swapped as :func:`~dflash_jax.decode.loop.replace_rows` does."""
    positions = jnp.broadcast_to(jnp.arange(fresh.cache.capacity, dtype=jnp.int32), (rows.shape[0], fresh.cache.capacity))

    def into(pool: PagedKVCache, part: KVCache) -> PagedKVCache:
        written = pool.replace(table=tables).write_all(part.k, part.v, positions)
        return written.replace(table=pool.table.at[rows].set(tables))

    def strip(s: DecodeState) -> DecodeState:
        return s.replace(cache=None, speculative=None if s.speculative is None else s.speculative.replace(context=None))

    merged = replace_rows(strip(state), strip(fresh), rows)
    spec = state.speculative
    return merged.replace(cache=into(state.cache, fresh.cache),
                          speculative=None if spec is None else merged.speculative.replace(context=into(spec.context, fresh.speculative.context)))
