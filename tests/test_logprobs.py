"""The target's log-probabilities recorded by the steps (``Decoding(logprobs=k)``).

Oracles: a no-cache recomputation (one full target pass over prompt + answer, ``log_softmax`` of
its logits at each answer position); plain decoding's recorded values, which DFlash (chain, tree,
scripted drafts accepted or refused, sampled rows) must repeat exactly (within float32 noise).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decode import loop as decode
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.decode.step import verify_block
from dflash_jax.errors import DFlashError
from dflash_jax.families.registry import module_for
from dflash_jax.testing import tiny_drafter, tiny_target, verify_scripted

PROMPTS = [[5, 9, 17, 3, 22, 8, 1], [40, 2, 7]]
K = 3


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=3)


def run(target, prompts, n_new, drafter=None, sampling=SamplingConfig(), **kw):
    cfg, params = target
    static = Decoding(cfg, None if drafter is None else drafter[0], logprobs=K, **kw)
    weights = Params(params, None if drafter is None else drafter[1])
    st = decode.init_state(static, prompts, 64, n_new, seed=7, sampling=sampling)
    return decode.decode_loop(weights, decode.prefill(weights, st, static, 4), static)


def recorded(st):
    """Per row: (answer ids, chosen [n], top ids [n, K], top [n, K]) on the host."""
    toks, plen, length, lp = jax.device_get((st.tokens, st.prompt_len, st.length, st.logprobs))
    out = []
    for b in range(toks.shape[0]):
        s = slice(int(plen[b]), int(length[b]))
        out.append((toks[b, s].tolist(), lp.chosen[b, s], lp.top_ids[b, s], lp.top[b, s]))
    return out


def full_pass_logprobs(target, ids):
    """``log_softmax`` of one no-cache target pass over ``ids`` ``[T]``: ``[T, V]``."""
    cfg, params = target
    mod = module_for(cfg)
    cache = mod.init_cache(cfg, 1, len(ids) + 1)
    hidden, _, _ = mod.forward_hidden(params, cfg, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None], cache)
    return np.asarray(jax.nn.log_softmax(mod.lm_head(params, cfg, hidden)[0].astype(jnp.float32), axis=-1))


def test_plain_equals_a_full_pass(target):
    for prompt, (ids, chosen, top_ids, top) in zip(PROMPTS, recorded(run(target, PROMPTS, 8))):
        ref = full_pass_logprobs(target, prompt + ids)
        at = ref[len(prompt) - 1 : len(prompt) - 1 + len(ids)]  # the row that chose each answer token
        np.testing.assert_allclose(chosen, at[np.arange(len(ids)), ids], atol=1e-5)
        np.testing.assert_allclose(top, -np.sort(-at, axis=-1)[:, :K], atol=1e-5)
        np.testing.assert_allclose(np.take_along_axis(at, top_ids, axis=-1), top, atol=1e-5)
        assert (top[:, 0] >= chosen - 1e-6).all() and not np.allclose(chosen, 0)


def same(a, b):
    for (ia, ca, tia, ta), (ib, cb, tib, tb) in zip(a, b):
        assert ia == ib
        np.testing.assert_allclose(ca, cb, atol=1e-5)
        np.testing.assert_allclose(ta, tb, atol=1e-5)
        assert (tia == tib).all()


@pytest.mark.parametrize("kw", [dict(), dict(tree=3), dict(n_max=2)])
def test_dflash_equals_plain(target, kw):
    d = tiny_drafter(target[0], seed=0, block_size=4, layer_ids=(0, 2))
    same(recorded(run(target, PROMPTS, 12, d, **kw)), recorded(run(target, PROMPTS, 12)))


def test_sampled_dflash_equals_plain(target):
    d = tiny_drafter(target[0], seed=0, block_size=4, layer_ids=(0, 2))
    s = SamplingConfig(temperature=0.8, top_k=20)
    same(recorded(run(target, PROMPTS, 12, d, s)), recorded(run(target, PROMPTS, 12, sampling=s)))


@pytest.mark.parametrize("corrupt_at", [None, 1])
def test_scripted_drafts_accepted_or_refused(target, corrupt_at):
    """Drafts of the greedy answer (all accepted, or refused from position 1): the recorded
    values are plain decoding's."""
    cfg, params = target
    plain = recorded(run(target, PROMPTS[:1], 10))[0]
    d = tiny_drafter(cfg, seed=0, block_size=4, layer_ids=(0, 2))
    static, weights = Decoding(cfg, d[0], logprobs=K), Params(params, d[1])
    st = decode.prefill(weights, decode.init_state(static, PROMPTS[:1], 64, 10), static, 4)
    st, accepts = verify_scripted(st, PROMPTS[0] + plain[0], 3, lambda s, dr: verify_block(weights, s, static, jnp.asarray([dr], jnp.int32)),
                                  corrupt_at, cfg.vocab_size)
    assert max(accepts) == (3 if corrupt_at is None else 1)
    same(recorded(st), [plain])


def test_off_by_default_and_checked(target):
    cfg, params = target
    st = decode.init_state(Decoding(cfg), PROMPTS, 64, 4)
    assert st.logprobs is None
    with pytest.raises(DFlashError, match="logprobs"):
        Decoding(cfg, logprobs=21)
    with pytest.raises(DFlashError, match="logprobs"):
        decode.decode_step(Params(params), st, Decoding(cfg, logprobs=2))
