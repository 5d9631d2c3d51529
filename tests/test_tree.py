"""Tree verification (dflash_jax.speculative.tree): best-first trees, the accept rule over a tree,
the accepted path's K/V compacted to a chain's slots, for dense and Laguna targets.

Oracles: the target's plain greedy decode, the caches of plain decoding and of a fresh prefill
(the compacted rows must be exactly what they hold), trees scripted from the target's own greedy
continuation (the accepted depth is known in advance) and the exact enumerated distribution at
T > 0 (test_spec's chi-square test).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import decode
from dflash_jax.decoding import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.sampling import SamplingConfig
from dflash_jax.speculative.commit import commit_block
from dflash_jax.speculative.tree import DraftTree, accept_tree, build_tree, verify_tree_fn
from dflash_jax.testing import tiny_drafter, tiny_target
from laguna_tiny import PER_HEAD, tiny_laguna
from test_spec import PROMPTS, assert_follows_target, outputs, plain_greedy

LAGUNA_PROMPT = [5, 17, 3, 42, 8, 9, 60, 33, 21, 7, 11, 2, 19, 44, 58, 13]  # 16 > the sliding window of 5


@pytest.fixture(scope="module")
def dense():
    return tiny_target("qwen3", seed=3)


@pytest.fixture(scope="module")
def laguna_target():
    return tiny_laguna(PER_HEAD, seed=4, max_block=8)


def run(target, d, prompts, n_new, n_max, tree, chunk=4, max_len=64, stop_ids=(), sampling=SamplingConfig(), seed=0):
    (cfg, params), (dcfg, dparams) = target, d
    static, w = Decoding(cfg, dcfg, sampling, n_max=n_max, tree=tree), Params(params, dparams)
    st = decode.init_state(static, prompts, max_len, n_new, stop_ids, seed=seed)
    return decode.generate(w, decode.prefill(w, st, static, chunk), static)


def make_tree(parents, tokens):
    """A batch-1 :class:`DraftTree` from block-index parents and target tokens of its nodes."""
    n = len(parents)
    mask = np.zeros((n + 1, n + 1), bool)
    mask[0, 0] = True
    depth = []
    for i, p in enumerate(parents, start=1):
        mask[i] = mask[p]
        mask[i, i] = True
        depth.append(0 if p == 0 else depth[p - 1])
        depth[-1] += 1
    arr = lambda x, t=jnp.int32: jnp.asarray(np.asarray(x)[None], t)  # noqa: E731
    return DraftTree(tokens=arr(tokens), parent=arr(parents), depth=arr(depth), alive=jnp.ones((1, n), bool), mask=arr(mask, bool))


def scripted_tree(cont, vocab):
    """Five nodes of depth <= 3 whose only correct path takes the second child twice:
    ``[x, c1, (x, c2 under c1), c3 under c2]`` (x: a wrong token), ``cont``: the drafts a chain
    should have made."""
    wrong = [(c + 1) % vocab for c in cont]
    return make_tree([0, 0, 2, 2, 4], [wrong[0], cont[0], wrong[1], cont[1], cont[2]])


def test_best_first_tree_takes_the_most_probable_paths():
    """Slot 1 prefers a (0.6) then b (0.3); slot 2 prefers c (0.9). Best-first over 4 nodes:
    a (0.6), a>c (0.54), b (0.3), b>c (0.27), in that order, each below its parent."""
    lp = np.log(np.array([[0.6, 0.3, 0.05, 0.05], [0.02, 0.03, 0.9, 0.05]]))
    index, tree = build_tree(jnp.asarray(lp[None], jnp.float32), 4)
    assert np.asarray(index).tolist() == [[0, 2, 1, 2]]
    assert np.asarray(tree.parent).tolist() == [[0, 1, 0, 3]] and np.asarray(tree.depth).tolist() == [[1, 2, 1, 2]]
    m = np.asarray(tree.mask[0]).astype(int).tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]


def test_accept_follows_the_target_through_the_tree():
    tree = make_tree([0, 0, 2, 2, 4], [7, 3, 9, 4, 5])
    chosen = jnp.asarray([[3, 0, 4, 0, 5, 6]], jnp.int32)  # the target's token after each block slot
    a, path = accept_tree(tree, chosen, tree.alive, 3)
    assert int(a[0]) == 3 and np.asarray(path).tolist() == [[0, 2, 4, 5]]
    a, path = accept_tree(tree, chosen, tree.alive.at[0, 4].set(False), 3)  # the deepest node may not be accepted
    assert int(a[0]) == 2 and np.asarray(path).tolist() == [[0, 2, 4, 3]]


@pytest.mark.parametrize("tree", [1, 3, 7, 15])
@pytest.mark.parametrize("n_max", [1, 3])  # tree > n_max and tree < n_max
def test_greedy_tree_decoding_equals_plain_greedy(dense, tree, n_max):
    d = tiny_drafter(dense[0], seed=0, block_size=4, layer_ids=(0, 2))
    want = plain_greedy(dense, PROMPTS, 20)
    assert outputs(run(dense, d, PROMPTS, 20, n_max, tree)) == want
    assert outputs(run(dense, d, PROMPTS, 20, n_max, tree, stop_ids=(want[0][5],))) == plain_greedy(dense, PROMPTS, 20, stop_ids=(want[0][5],))


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_greedy_tree_decoding_on_laguna_equals_plain_greedy(laguna_target, chunk):
    from test_laguna_drafter import plain_greedy as laguna_plain

    d = tiny_drafter(laguna_target[0], seed=2, block_size=4, layer_ids=(0, 2))
    got = outputs(run(laguna_target, d, [LAGUNA_PROMPT, LAGUNA_PROMPT[:7]], 14, 3, 7, chunk=chunk, max_len=48))
    assert got == [laguna_plain(laguna_target, LAGUNA_PROMPT, 14), laguna_plain(laguna_target, LAGUNA_PROMPT[:7], 14)]


def scripted_tree_run(target, d, prompt, n_new, max_len, n_max=3, check=None):
    """Tree steps scripted from the target's greedy continuation (:func:`scripted_tree`) until the
    row is done, ``check(state)`` after each: ``(state, accepted per step, plain decoding's state)``."""
    (cfg, params), (dcfg, dparams) = target, d
    s_plain = Decoding(cfg)
    plain = decode.init_state(s_plain, [prompt], max_len, n_new)
    plain = decode.generate(Params(params), decode.prefill(Params(params), plain, s_plain, 4), s_plain)
    ref = outputs(plain)[0] + [0] * 4
    static, w = Decoding(cfg, dcfg, n_max=n_max, tree=5), Params(params, dparams)
    st = decode.prefill(w, decode.init_state(static, [prompt], max_len, n_new), static, 4)
    step = jax.jit(lambda w, s, t: commit_block(w, s, static, verify_tree_fn(w, s, static, t)))
    accepts = []
    while not bool(st.done[0]):
        k = int(st.length[0]) - len(prompt)
        before = int(st.speculative.accepted[0])
        st = step(w, st, scripted_tree(ref[k : k + 3], cfg.vocab_size))
        accepts.append(int(st.speculative.accepted[0]) - before)
        if check is not None:
            check(st)
    return st, accepts, plain


def committed_rows(cfg, cache, n):
    """The K/V rows of positions ``[0, n)`` that later queries can read: every full-attention
    slot, and the ring rows of a sliding layer that hold the last ``sliding_window`` positions."""
    if not hasattr(cache, "ring_pos"):
        return [np.asarray(cache.k[:, :, :n]), np.asarray(cache.v[:, :, :n])]
    from dflash_jax.models.laguna import cache_entries

    pos = np.asarray(cache.ring_pos[0])
    live = np.nonzero((pos < n) & (pos >= n - cfg.sliding_window))[0]
    out = [pos[live]]
    for key, (_, sliding) in sorted(cache_entries(cfg).items()):
        k, v = (np.asarray(x) for x in cache.kv[key])
        out += [k[:, :, live], v[:, :, live]] if sliding else [k[:, :, :n], v[:, :, :n]]
    return out


@pytest.mark.parametrize("family", ["dense", "laguna"])
def test_the_accepted_path_lands_where_a_chain_puts_it(family, dense, laguna_target):
    """Every scripted step accepts the tree's second-child path (3 drafts), the output is plain
    greedy's, and the target cache holds exactly plain decoding's K/V at every committed position
    (a compaction that left a row in its tree slot, or moved the wrong one, fails here)."""
    target, prompt = (dense, PROMPTS[0]) if family == "dense" else (laguna_target, LAGUNA_PROMPT)
    d = tiny_drafter(target[0], seed=1, block_size=4, layer_ids=(0, 2))
    st, accepts, plain = scripted_tree_run(target, d, prompt, 13, 48)
    assert outputs(st) == outputs(plain)
    assert accepts == [3, 3, 3]  # the prefill's token, then 3 drafts and a bonus token per step: 13 tokens
    n = int(st.length[0]) - 1
    for a, b in zip(committed_rows(target[0], st.cache, n), committed_rows(target[0], plain.cache, n)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # float32: a tree pass sums in another order


@pytest.mark.parametrize("n_max", [3, 7])  # 7: more draft slots than the tree's 5 nodes
def test_the_drafter_context_after_a_tree_step_is_a_fresh_prefill(dense, n_max):
    """After scripted tree steps the drafter context of every committed position equals the one a
    fresh prefill of the committed tokens projects (the captured rows were moved with the path),
    and no slot of it is ever NaN (the rows past a path are the drafter's to mask, not to read
    as NaN: attention multiplies them by zero)."""
    cfg, params = dense
    d = tiny_drafter(cfg, seed=1, block_size=n_max + 1, layer_ids=(0, 2))

    def finite(st):
        assert np.isfinite(np.asarray(st.speculative.ctx_k)).all() and np.isfinite(np.asarray(st.speculative.ctx_v)).all()

    st, _, _ = scripted_tree_run(dense, d, PROMPTS[0], 13, 48, n_max=n_max, check=finite)
    n = int(st.length[0]) - 1
    static = Decoding(cfg, d[0], n_max=n_max)
    committed = [int(t) for t in np.asarray(st.tokens[0, :n])]
    fresh = decode.prefill(Params(params, d[1]), decode.init_state(static, [committed], 48, 1), static, 4)
    np.testing.assert_allclose(np.asarray(st.speculative.ctx_k[:, 0, : n - 1]), np.asarray(fresh.speculative.ctx_k[:, 0, : n - 1]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.speculative.ctx_v[:, 0, : n - 1]), np.asarray(fresh.speculative.ctx_v[:, 0, : n - 1]), rtol=1e-4, atol=1e-5)


def test_sampled_tree_tokens_follow_target_distribution():
    """Chi-square of three sampled tokens over many rows against the exact target distribution,
    with a tree of 5 nodes over 2 slots (the test of test_spec, for trees)."""
    cfg, params = tiny_target("llama", seed=11, vocab_size=8, scale=0.5)
    d = tiny_drafter(cfg, seed=1, block_size=4, layer_ids=(0, 2), scale=0.5)
    prompt, n, sampling = [1, 5, 2], 6000, SamplingConfig(1.0)
    st = run((cfg, params), d, [prompt] * n, 3, 2, 5, max_len=8, sampling=sampling, seed=123)
    assert (np.asarray(st.length) == 6).all()
    assert int(np.asarray(st.speculative.accepted).sum()) > n // 10, "the tree should get drafts accepted"
    assert_follows_target(cfg, params, prompt, sampling, np.asarray(st.tokens[:, 3:6]))


def test_a_seeded_row_samples_the_same_tokens_with_a_tree_or_without_a_drafter(dense):
    d = tiny_drafter(dense[0], seed=2, block_size=4, layer_ids=(0, 2))
    sampling = SamplingConfig(0.7)
    cfg, params = dense
    s = Decoding(cfg, sampling=sampling)
    st = decode.init_state(s, PROMPTS, 64, 20, seed=5)
    want = outputs(decode.generate(Params(params), decode.prefill(Params(params), st, s, 4), s))
    assert outputs(run(dense, d, PROMPTS, 20, 3, 6, sampling=sampling, seed=5)) == want


def test_tree_settings_that_do_not_go_together_are_named(dense, laguna_target):
    cfg = dense[0]
    dcfg = tiny_drafter(cfg, block_size=4, layer_ids=(0, 2))[0]
    for kw, match in ((dict(tree=0), r"tree \(--tree\).*\[1, 15\]"), (dict(tree=16), r"\[1, 15\]"), (dict(tree=True), "tree"),
                      (dict(tree=3, n_max="auto"), "fixed n_max"), (dict(tree=3, draft_mode="sample"), "draft_mode='argmax'")):
        with pytest.raises(DFlashError, match=match):
            Decoding(cfg, dcfg, **kw)
    with pytest.raises(DFlashError, match="without a drafter"):
        Decoding(cfg, tree=3)
    with pytest.raises(DFlashError, match=r"\[1, 7\]"):  # a Laguna target's max_block of 8 bounds the pass
        Decoding(laguna_target[0], tiny_drafter(laguna_target[0], block_size=4, layer_ids=(0, 2))[0], tree=8)
