"""Paged KV (dflash_jax/runtime/carry.py PagedKVCache, dflash_jax/serve/pages.py): a serving batch whose
target cache and drafter context live in a shared pool of pages.

Oracles: the same requests decoded by an unpaged batch (tokens, lengths, finish codes and DFlash
acceptance, greedy and seeded sampled rows mixed), and the host ledger's page counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SERVE_MAX_LEN

import dflash_jax as dj
from dflash_jax.decode.state import Decoding, Params
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
    if batch.pool is not None:  # the engine grows rows round by round; here: their whole answer (and a verify's reach) at once
        batch.grow({r: len(PROMPTS[i]) + BUDGETS[i] + 4 for r, i in zip(rows, idx)})


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
    assert held == {2: -(-(90 + 7 + 4) // 16), 3: -(-(18 + 20 + 4) // 16)}
    paged.release([2, 3])
    assert paged.pool.free == paged.pool.total and not np.asarray(paged.state.cache.table).any()


def test_the_ledger_hands_out_pages_as_rows_grow():
    pool = PagePool(pages=11, page_size=16, max_len=160)  # 10 pages to hand out
    assert pool.pages(33) == 3 and pool.pages(1000) == 10  # at most a whole row's
    assert pool.fits([3, 4, 4]) == 2 and pool.fits([3, 4, 4], keep=4) == 1
    assert pool.grow(0, 20) and not pool.grow(0, 32) and pool.grow(0, 40)
    table = pool.table(0)
    assert len(table) == 10 and table[3:] == [0] * 7 and 0 not in table[:3] and pool.free == 7
    assert pool.short({0: 64, 1: 100}) == 1 + 7
    with pytest.raises(RuntimeError):
        pool.grow(1, 160)
    pool.give(0)
    assert pool.fits([10]) == 1
    with pytest.raises(DFlashError, match=r"--kv-cache-mb.*at least 10 pages"):
        PagePool(pages=10, page_size=16, max_len=160)


def by_hand(engine, model):
    """Readies ``engine`` for rounds driven by hand (no warm-up: every batch size may compile at its first use)."""
    engine._switch(model.decoding())
    engine._warm.ready = list(engine._warm.sizes)


def test_the_engine_admits_by_pages_and_holds_more_short_rows_than_the_budget_holds_unpaged(serve_tiny_model):
    """A budget of two unpaged rows of SERVE_MAX_LEN: unpaged, the engine runs 2 rows; paged, six
    short requests (3 pages each) run at once and answer as the unpaged engine does. When the pool
    cannot take the next request and the queue is full, a new one is refused as out of KV pages."""
    from dflash_jax.serve.engine import Engine, NoFreePages
    from dflash_jax.serve.jobs import Done, Job, JobSpec, ServedModel, Text
    from dflash_jax.serve.metrics import Metrics
    from dflash_jax.serve.pages import row_bytes

    _, target, drafter = serve_tiny_model
    model = ServedModel(target, drafter, name="tiny", n_max=3)
    budget = 2 * row_bytes(model.decoding(), SERVE_MAX_LEN)
    specs = [JobSpec(prompt=tuple(PROMPTS[i % 4][:20]), max_new=24, static=model.decoding(), seed=i,
                     sampling=SAMPLING[i % 4]) for i in range(6)]

    def serve(paged, specs=specs, budget=budget):
        engine = Engine(model, max_batch=8, max_len=SERVE_MAX_LEN, max_queue=8, kv_cache_bytes=budget, paged=paged, prefix_cache_bytes=0,
                        metrics=Metrics())
        by_hand(engine, model)
        jobs = [Job(s) for s in specs]
        for j in jobs:
            engine.submit(j)
        peak = 0
        while any(r is not None for r in engine._rows) or engine._queue or engine._prefill is not None:
            engine._round()
            peak = max(peak, sum(r is not None for r in engine._rows))
        events = [_drain(j) for j in jobs]
        return engine, peak, events

    rows_engine, rows_peak, rows_events = serve(False)
    paged_engine, paged_peak, paged_events = serve(True)
    assert rows_engine.max_batch == 2 and rows_peak == 2
    assert paged_peak == 6 and paged_engine._batch.pool.free == paged_engine._batch.pool.total
    texts = [["".join(e.text for e in ev if isinstance(e, Text)) for ev in evs] for evs in (rows_events, paged_events)]
    assert texts[0] == texts[1] and all(isinstance(ev[-1], Done) for ev in paged_events)

    # one row's budget and three long answers: the rows grow into each other, the last admitted are
    # preempted and resume where they stopped (greedy and seeded sampled alike)
    long = [dataclasses.replace(s, max_new=120) for s in specs[:3]]
    one = row_bytes(model.decoding(), SERVE_MAX_LEN)
    (rows_engine, _, rows_events), (paged_engine, peak, paged_events) = serve(False, long, one), serve(True, long, one)
    texts = [["".join(e.text for e in ev if isinstance(e, Text)) for ev in evs] for evs in (rows_events, paged_events)]
    assert texts[0] == texts[1] and peak == 3 and paged_engine.metrics.preemptions._value.get() > 0
    assert [ev[-1].completion_tokens for ev in paged_events] == [ev[-1].completion_tokens for ev in rows_events]

    # a graceful shutdown right after a preemption: the preempted request was running, so it
    # resumes and finishes with the same answer rather than getting the shutdown's 503
    engine = Engine(model, max_batch=8, max_len=SERVE_MAX_LEN, max_queue=8, kv_cache_bytes=one, paged=True, prefix_cache_bytes=0,
                    metrics=Metrics())
    by_hand(engine, model)
    jobs = [Job(s) for s in long]
    for j in jobs:
        engine.submit(j)
    while engine.metrics.preemptions._value.get() == 0:
        engine._round()
    engine._stopping, engine._deadline = True, float("inf")
    while engine._round():
        pass
    events = [_drain(j) for j in jobs]
    assert all(isinstance(ev[-1], Done) for ev in events)
    assert ["".join(e.text for e in ev if isinstance(e, Text)) for ev in events] == texts[0]

    engine = Engine(model, max_batch=8, max_len=SERVE_MAX_LEN, max_queue=1, kv_cache_bytes=budget, paged=True, prefix_cache_bytes=0)
    by_hand(engine, model)
    for r in (5, 6):  # every page held (two rows of max_len)
        engine._batch.pool.grow(r, SERVE_MAX_LEN)
    engine.submit(Job(specs[0]))
    engine._round()  # nothing is admitted: no pages
    assert engine.counts() == (0, 1)
    with pytest.raises(NoFreePages, match=r"no free KV pages: 0 of 20 pages.*--kv-cache-mb"):
        engine.submit(Job(specs[1]))


def _drain(job):
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def test_the_layout_sizes_the_pool_and_the_rows(serve_tiny_model):
    """Paged, the rows are at most the pool's pages, and a ``max_len`` that is not a whole number of
    pages still gets a pool that holds one such request; unpaged, the budget caps the rows."""
    from dflash_jax.serve.pages import kv_layout, row_bytes

    _, target, drafter = serve_tiny_model
    static = Decoding(target.cfg, drafter.cfg, n_max=3)
    one = row_bytes(static, 512)
    paged = kv_layout(static, max_batch=64, max_len=512, budget=one)
    assert paged.paged and paged.rows == 32 == paged.pages_for(static) - 1
    odd = kv_layout(static, max_batch=1, max_len=1000)
    PagePool(odd.pages_for(static), 16, 1000)  # room for one request of 1000 tokens (63 pages)
    rows = kv_layout(static, max_batch=64, max_len=512, budget=3 * one + 1, paged=False)
    assert not rows.paged and rows.rows == 3
    with pytest.raises(DFlashError, match=r"--kv-cache-mb.*one request of --max-len 512"):
        kv_layout(static, max_batch=4, max_len=512, budget=one // 2)
