"""Paged KV (dflash_jax/cache.py PagedKVCache, dflash_jax/serve/pages.py): a serving batch whose
target cache and drafter context live in a shared pool of pages.

Oracles: the same requests decoded by an unpaged batch (tokens, lengths, finish codes and DFlash
acceptance, greedy and seeded sampled rows mixed), and the host ledger's page counts.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SERVE_MAX_LEN

import dflash_jax as dj
from dflash_jax.decoding import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.serve.batch import Batch
from dflash_jax.serve.pages import PagePool

RNG = np.random.default_rng(5)
PROMPTS = [[int(x) for x in RNG.integers(3, 200, size=n)] for n in (37, 5, 90, 18)]
SAMPLING = [dj.SamplingConfig(), dj.SamplingConfig(temperature=0.8, top_p=0.9), dj.SamplingConfig(), dj.SamplingConfig(temperature=1.0)]
BUDGETS = [12, 30, 7, 20]


def _batch(model, pages):
    _, target, drafter = model
    static = Decoding(target.cfg, drafter.cfg, n_max=3)
    return Batch(Params(target.params, drafter.params), static, 4, SERVE_MAX_LEN, 2, 64, kv_pages=pages)


def _admit(batch, rows, idx):
    p = batch.start_prefill(rows, [PROMPTS[i] for i in idx], [BUDGETS[i] for i in idx], [11 + i for i in idx], [[10**6]] * len(idx),
                            [SAMPLING[i] for i in idx])
    while not p.complete:
        batch.prefill_step(p)


def _answers(batch, rows):
    tokens, length, finish = batch.read()
    acc = np.asarray(batch.state.speculative.accepted)
    return [(tokens[r, : length[r]].tolist(), int(finish[r]), int(acc[r])) for r in rows]


def _waves(batch):
    """Two requests, then both freed and two others in the other rows: a freed row whose table still
    pointed at its old pages would write into the pages the new rows were given."""
    _admit(batch, [0, 1], [0, 1])
    batch.run(4, 200)
    first = _answers(batch, [0, 1])
    batch.release([0, 1])
    _admit(batch, [2, 3], [2, 3])
    batch.run(4, 200)
    return first + _answers(batch, [2, 3])


def test_a_paged_batch_decodes_as_an_unpaged_one(serve_tiny_model):
    pages = -(-SERVE_MAX_LEN // 16) + 1  # room for one full-length row: the rows share it
    paged, rows = _batch(serve_tiny_model, pages), _batch(serve_tiny_model, None)
    got, want = _waves(paged), _waves(rows)
    assert got == want
    held = {r: len(paged.pool.held[r]) for r in (2, 3)}
    assert held == {2: -(-(90 + 7) // 16), 3: -(-(18 + 20) // 16)}
    paged.release([2, 3])
    assert paged.pool.free == paged.pool.total and not np.asarray(paged.state.cache.table).any()


def test_the_ledger_admits_by_free_pages():
    pool = PagePool(pages=11, page_size=16, max_len=160)  # 10 pages to hand out
    assert pool.need(20, 100) == 8 and pool.need(150, 100) == 10  # capped at max_len
    assert pool.fits([3, 4, 4]) == 2
    table = pool.take(0, 3)
    assert len(table) == 10 and table[3:] == [0] * 7 and 0 not in table[:3]
    assert pool.fits([8]) == 0 and pool.free == 7
    pool.give(0)
    assert pool.fits([8]) == 1
    with pytest.raises(DFlashError, match=r"--kv-cache-mb.*at least 10 pages"):
        PagePool(pages=10, page_size=16, max_len=160)
