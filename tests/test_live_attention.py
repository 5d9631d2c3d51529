"""Attention that reads only the live prefix of the cache (dflash_jax.nn.attention).

Oracles: the softmax formula written out in numpy; the target's greedy decode recomputed without a
cache; plain greedy decoding for DFlash rows of very different lengths. The suite runs every model
with key blocks of 16 slots (conftest.py), so these cases cross block boundaries in prefill,
decode, verify, rollback and the drafter context; the unit cases also use the production size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.decode import loop as decode
from dflash_jax.runtime.compiled import count_compilations
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.families.dense import model as dense
from dflash_jax.nn.attention import cache_attention, live_keys
from dflash_jax.decode.state import CAPACITY
from dflash_jax.testing import tiny_drafter, tiny_target


def softmax_attention(q, k, v, mask):
    """The formula: ``softmax(q k^T / sqrt(D)) v`` over the visible keys, grouped heads, float64;
    a query that sees nothing gives zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, t, hq, d))
    for bi in range(b):
        for ti in range(t):
            seen = np.asarray(mask[bi, ti])
            if not seen.any():
                continue
            for h in range(hq):
                lg = k[bi, seen, h // g] @ q[bi, ti, h] / np.sqrt(d)
                p = np.exp(lg - lg.max())
                out[bi, ti, h] = (p / p.sum()) @ v[bi, seen, h // g]
    return out


@pytest.mark.parametrize(
    "b,t,cap,hkv,g,key_block",
    [(2, 1, 700, 3, 3, 256), (2, 16, 600, 2, 2, 256), (3, 40, 300, 2, 4, 64), (1, 5, 64, 1, 1, 256), (2, 3, 50, 2, 1, 16)],
)
def test_cache_attention_is_the_softmax_formula(b, t, cap, hkv, g, key_block):
    """Flat (<= 32 queries) and head-batched forms; capacities that are not a multiple of the key
    block (the last block overlaps the one before); live prefixes ending exactly on, just past and
    inside a block; an extra key/value part under the same softmax; a query that sees nothing."""
    d, layer = 8, 1
    r = np.random.default_rng(b * t + cap)
    kc, vc = (jnp.asarray(r.normal(size=(2, b, cap, hkv, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(r.normal(size=(b, t, hkv * g, d)), jnp.float32)
    ek, ev = (jnp.asarray(r.normal(size=(b, t, hkv, d)), jnp.float32) for _ in range(2))
    for last in sorted({key_block - 1, key_block, key_block + 1, cap - 1, cap // 3}):
        if last < t - 1 or last >= cap:
            continue
        pos = jnp.asarray(np.stack([np.arange(t) + last - t + 1 - i % 2 * min(3, last - t + 1) for i in range(b)]), jnp.int32)
        em = np.asarray(pos[:, :, None] >= pos[:, None, :])
        seen = np.arange(cap)[None, None, :] < np.asarray(pos)[:, :, None]  # strictly earlier: row 0 of position 0 sees none
        got = cache_attention(q, kc, vc, layer, live_keys(pos, cap), lambda s: s[None, None, :] < pos[:, :, None],
                              extra=((ek, ev, jnp.asarray(em)),), key_block=key_block)
        want = softmax_attention(q, np.concatenate([kc[layer], ek], 1), np.concatenate([vc[layer], ev], 1),
                                 np.concatenate([seen, em], 2))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, err_msg=f"last position {last}")
        alone = cache_attention(q, kc, vc, layer, live_keys(pos, cap), lambda s: s[None, None, :] < pos[:, :, None], key_block=key_block)
        np.testing.assert_allclose(np.asarray(alone), softmax_attention(q, kc[layer], vc[layer], seen), atol=2e-5)
        static = cache_attention(q, kc, vc, layer, cap, lambda s: s[None, None, :] < pos[:, :, None])
        np.testing.assert_allclose(np.asarray(static), softmax_attention(q, kc[layer], vc[layer], seen), atol=2e-5)


def test_blocks_past_the_live_prefix_are_never_read():
    """Cost follows the live context: slots in key blocks past ``n_keys`` are not touched (NaN
    there would poison the output if they were, as it did when every step read the capacity)."""
    b, t, cap, hkv, d, blk = 2, 1, 1000, 2, 8, 256
    r = np.random.default_rng(0)
    kc = np.asarray(r.normal(size=(1, b, cap, hkv, d)), np.float32)
    vc = kc.copy()
    kc[:, :, 2 * blk :], vc[:, :, 2 * blk :] = np.nan, np.nan
    q = jnp.asarray(r.normal(size=(b, t, 2 * hkv, d)), jnp.float32)
    pos = jnp.asarray([[300], [511]], jnp.int32)
    out = cache_attention(q, jnp.asarray(kc), jnp.asarray(vc), 0, live_keys(pos, cap), lambda s: s[None, None, :] <= pos[:, :, None], key_block=blk)
    assert np.isfinite(np.asarray(out)).all()
    assert int(live_keys(jnp.asarray([[4, cap], [7, cap]]), cap)) == 8  # padding positions (= capacity) do not count


def _recomputed_greedy(cfg, params, seq, prompt_len):
    """Each generated token is the argmax of a fresh, cache-less forward over the sequence so far."""
    logits, _, _ = jax.jit(dense.MODEL.forward, static_argnums=1)(params, cfg, jnp.asarray([seq]), jnp.arange(len(seq))[None],
                                                             dense.MODEL.init_cache(cfg, 1, len(seq)))
    return [int(x) for x in np.argmax(np.asarray(logits[0, prompt_len - 1 : -1]), -1)]


def test_decode_across_key_blocks_to_exactly_the_capacity():
    """Greedy decoding through several 16-slot key blocks until the capacity (53, not a multiple
    of 16) is reached exactly equals the cache-less recomputation, for a short and a long row."""
    cfg, params = tiny_target("llama", seed=5)
    prompts = [[5, 9, 17], list(range(3, 34))]
    static = Decoding(cfg)
    st = decode.init_state(static, prompts, 53, 100)
    st = decode.decode_loop(Params(params), decode.prefill(Params(params), st, static, 7), static)
    assert list(np.asarray(st.finish)) == [CAPACITY, CAPACITY]
    for b, p in enumerate(prompts):
        seq = [int(x) for x in np.asarray(st.tokens[b, :53])]
        assert seq[: len(p)] == p
        assert seq[len(p):] == _recomputed_greedy(cfg, params, seq, len(p))


def test_dflash_rows_of_very_different_lengths_cross_blocks_as_plain_greedy():
    """DFlash with rows of 2, 21 and 60 prompt tokens (verify blocks and rollbacks straddle key
    block boundaries at different steps per row) commits exactly plain greedy decoding's tokens."""
    cfg, params = tiny_target("qwen3", seed=3)
    d_cfg, d_params = tiny_drafter(cfg, seed=2, block_size=5, layer_ids=(0, 2))
    prompts = [[5, 9], list(range(7, 28)), [int(x) for x in np.random.default_rng(1).integers(1, cfg.vocab_size, 60)]]
    runs = {}
    for name, static, p in [("plain", Decoding(cfg), Params(params)), ("dflash", Decoding(cfg, d_cfg), Params(params, d_params))]:
        st = decode.init_state(static, prompts, 96, 30)
        st = decode.decode_loop(p, decode.prefill(p, st, static, 16), static)
        runs[name] = [np.asarray(st.tokens[b, len(q) : len(q) + 30]).tolist() for b, q in enumerate(prompts)]
        if name == "dflash":
            assert int(np.asarray(st.speculative.accepted).sum()) > 0  # some drafts were kept and rolled back around
    assert runs["dflash"] == runs["plain"]


def test_another_prompt_and_budget_compile_nothing():
    """The default capacity and prefill chunk come from fixed buckets, so a second ``generate``
    with a prompt of another length and another budget reuses the compiled programs."""
    cfg, params = tiny_target("llama", seed=1)
    target = dj.Target(cfg=cfg, params=params, tokenizer=None, source="tiny", eos_ids=())
    first = dj.generate(target, [[5, 9, 17, 3, 22, 8, 1]], max_new_tokens=5)
    with count_compilations() as compiled:
        second = dj.generate(target, [list(range(2, 40))], max_new_tokens=9)
    assert compiled() == 0
    assert first.stats["max_len"] == second.stats["max_len"] == min(1024, cfg.max_position_embeddings)
    assert len(second.output_ids[0]) == 9

