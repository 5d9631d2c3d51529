"""The prefix cache (dflash_jax/serve/prefix_cache.py): a prompt that starts with cached blocks
gets the target's K/V and the drafter's context of those blocks copied in and prefills the rest.

Oracles: the same prompt prefilled whole by a batch without a cache (its cache and drafter context
rows, then its decoded tokens) and ``generate`` through the ``openai`` client.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SERVE_MAX_LEN
from serve_util import raw

import dflash_jax as dj
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.serve.batch import Batch
from dflash_jax.serve.prefix_cache import BLOCK, PrefixCache, chain_keys, supports

RNG = np.random.default_rng(0)
SHARED = [int(x) for x in RNG.integers(3, 200, size=140)]


def prefilled(model, prompt, prefix, rows=(0,)):
    """A batch of one row of the tiny pair with ``prompt`` prefilled (through ``prefix``, a cache or ``None``)."""
    _, target, drafter = model
    static = Decoding(target.cfg, drafter.cfg, n_max=3)
    batch = Batch(Params(target.params, drafter.params), static, 1, SERVE_MAX_LEN, 2, 64, prefix=prefix)
    p = batch.start_prefill(list(rows), [prompt], [12], [0], [[10**6]], [dj.SamplingConfig()])
    while not p.complete:
        batch.prefill_step(p)
    return batch, p


def test_a_prompt_restored_from_cached_blocks_equals_one_prefilled_whole(serve_tiny_model):
    cache = PrefixCache(1 << 30)
    first = SHARED + [7, 8, 9]
    _, p = prefilled(serve_tiny_model, first, cache)
    assert p.cached == 0 and len(cache) == len(first) // BLOCK == 2
    second = SHARED[:130] + [11, 12, 13, 14, 15]
    assert cache.cached(second) == 2 * BLOCK and cache.cached(SHARED[:1] + SHARED) == 0  # a chain: the same tokens before
    reused, p = prefilled(serve_tiny_model, second, cache)
    whole, _ = prefilled(serve_tiny_model, second, None)
    assert p.cached == 2 * BLOCK
    n = len(second)
    for got, want in ((reused.state.cache.k, whole.state.cache.k), (reused.state.cache.v, whole.state.cache.v),
                      (reused.state.speculative.ctx_k, whole.state.speculative.ctx_k),
                      (reused.state.speculative.ctx_v, whole.state.speculative.ctx_v)):
        np.testing.assert_allclose(np.asarray(got)[:, 0, :n], np.asarray(want)[:, 0, :n], rtol=1e-5, atol=1e-5)
    for b in (reused, whole):
        b.run(1, 64)
    assert np.asarray(reused.state.tokens).tolist() == np.asarray(whole.state.tokens).tolist()
    assert int(reused.state.speculative.accepted[0]) == int(whole.state.speculative.accepted[0])


def test_the_cache_evicts_least_recently_used_blocks_within_its_budget(serve_tiny_model):
    probe = PrefixCache(1 << 30)
    prefilled(serve_tiny_model, SHARED[:65], probe)
    block_bytes = probe.bytes
    cache = PrefixCache(2 * block_bytes)
    a, b = [1] * 70, [2] * 70
    prefilled(serve_tiny_model, a, cache)
    prefilled(serve_tiny_model, b, cache)
    assert cache.cached(a + [0]) == BLOCK  # a used again: b is the least recently used
    prefilled(serve_tiny_model, [3] * 70, cache)
    assert (cache.cached(a + [0]), cache.cached(b + [0]), cache.cached([3] * 71)) == (BLOCK, 0, BLOCK)
    assert cache.bytes == 2 * block_bytes and len(cache) == 2


def test_chain_keys_hash_every_token_before_a_block_end():
    a = list(range(200))
    b = a[:100] + [0] + a[101:]
    assert len(chain_keys(a, 199)) == 3 and len(chain_keys(a, 191)) == 2
    assert chain_keys(a, 200)[0] == chain_keys(b, 200)[0] and chain_keys(a, 200)[1:] != chain_keys(b, 200)[1:]


def test_laguna_rings_keep_the_cache_off():
    from laguna_tiny import tiny_laguna

    from dflash_jax.decode import loop as decode

    cfg, _ = tiny_laguna()
    state = decode.init_state(Decoding(cfg), [[1, 2]], 64, 4)
    assert not supports(state)


def test_a_second_request_sharing_a_prompt_reuses_its_blocks(serve_tiny, serve_tiny_model):
    """Through the ``openai`` client: the second request reports the cached tokens in its usage,
    answers what ``generate`` answers alone and the server counts the tokens in ``/metrics``."""
    import openai

    url, engine = serve_tiny
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = engine.metrics.prefix_hit_tokens._value.get() if engine.metrics else None
    shared = [int(x) for x in RNG.integers(3, 200, size=129)]
    answers = []
    for tail in ([5, 6], [9, 9, 9]):
        r = c.completions.create(model="tiny", prompt=shared + tail, max_tokens=16, temperature=0)
        want = dj.generate(serve_tiny_model[1], [shared + tail], max_new_tokens=16, drafter=serve_tiny_model[2], max_len=SERVE_MAX_LEN)
        assert r.choices[0].text == want.texts[0]
        answers.append(r)
    assert [a.usage.prompt_tokens_details.cached_tokens for a in answers] == [0, 2 * BLOCK]
    status, _, body = raw(url + "/metrics")
    assert status == 200 and b"dflash_prefix_cache_hit_tokens_total" in body and b"dflash_prefix_cache_bytes" in body
    if before is not None:
        assert engine.metrics.prefix_hit_tokens._value.get() - before == 2 * BLOCK


@pytest.mark.parametrize("mb", ["-1", "nan", "inf"])
def test_serve_refuses_a_negative_prefix_budget(mb):
    from dflash_jax.cli.main import main

    assert main(["serve", "--prefix-cache-mb", mb, "--port", "1"]) == 2
