"""Tree verification (dflash_jax.decode.tree): best-first trees, the accept rule over a tree,
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

from dflash_jax.decode import loop as decode
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.decode.step import commit_block
from dflash_jax.decode.tree import DraftTree, accept_tree, build_tree, verify_tree_fn
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
    static, w = Decoding(cfg, dcfg, n_max=n_max, tree=tree), Params(params, dparams)
    st = decode.init_state(static, prompts, max_len, n_new, stop_ids, seed=seed, sampling=sampling)
    return decode.decode_loop(w, decode.prefill(w, st, static, chunk), static)


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
    plain = decode.decode_loop(Params(params), decode.prefill(Params(params), plain, s_plain, 4), s_plain)
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
    from dflash_jax.families.laguna.model import cache_entries

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
    s = Decoding(cfg)
    st = decode.init_state(s, PROMPTS, 64, 20, seed=5, sampling=sampling)
    want = outputs(decode.decode_loop(Params(params), decode.prefill(Params(params), st, s, 4), s))
    assert outputs(run(dense, d, PROMPTS, 20, 3, 6, sampling=sampling, seed=5)) == want


def test_tree_settings_that_do_not_go_together_are_named(dense, laguna_target):
    cfg = dense[0]
    dcfg = tiny_drafter(cfg, block_size=4, layer_ids=(0, 2))[0]
    for kw, match in ((dict(tree=0), r"tree \(--tree\).*\[1, 15\]"), (dict(tree=16), r"\[1, 15\]"), (dict(tree=True), "tree"),
                      (dict(tree=3, draft_mode="sample"), "draft_mode='argmax'")):
        with pytest.raises(DFlashError, match=match):
            Decoding(cfg, dcfg, **kw)
    auto = Decoding(cfg, dcfg, n_max="auto", auto_depth=2, tree=5)  # auto over a tree 2 deep
    assert (auto.depth, auto.verify_top, auto.width) == (2, 5, 3)
    with pytest.raises(DFlashError, match="without a drafter"):
        Decoding(cfg, tree=3)
    with pytest.raises(DFlashError, match=r"\[1, 7\]"):  # a Laguna target's max_block of 8 bounds the pass
        Decoding(laguna_target[0], tiny_drafter(laguna_target[0], block_size=4, layer_ids=(0, 2))[0], tree=8)


def run_auto_tree(target, d, prompts, n_new, model, tree=7, calibration=None, sampling=SamplingConfig(), seed=0, chunk=4, max_len=64):
    """Decodes under ``n_max="auto"`` over a best-first tree of ``tree`` nodes with the cost model given."""
    from dflash_jax.decode.auto.costs import depth_policy
    from dflash_jax.decode.auto.policy import Calibration

    (cfg, params), (dcfg, dparams) = target, d
    static = Decoding(cfg, dcfg, n_max="auto", tree=tree)
    policy = depth_policy(calibration or Calibration.identity(static.depth), model, depth=static.depth)
    w = Params(params, dparams, policy)
    st = decode.init_state(static, prompts, max_len, n_new, seed=seed, sampling=sampling)
    return decode.decode_loop(w, decode.prefill(w, st, static, chunk), static)


def test_auto_over_a_tree_is_lossless_at_every_width_it_may_choose(dense):
    """Under ``n_max="auto"`` with ``tree=15`` a step verifies the first 3, 7 or 15 nodes of its
    tree (``tree_widths``), or takes a plain step: greedy output equals plain greedy at each forced
    width, with a policy that chooses, and when drafting never pays; ``widths`` counts the nodes
    verified; one compiled loop serves them all (the policy is traced)."""
    from dflash_jax.runtime.compiled import count_compilations
    from dflash_jax.decode.auto.costs import CostModel
    from dflash_jax.decode.auto.policy import tree_widths

    assert (tree_widths(1), tree_widths(2), tree_widths(3), tree_widths(7), tree_widths(15)) == ((1,), (2,), (3,), (3, 7), (3, 7, 15))
    d = tiny_drafter(dense[0], seed=0, block_size=4, layer_ids=(0, 2))
    want = plain_greedy(dense, PROMPTS, 20)
    widths = (3, 7, 15)
    run_auto_tree(dense, d, PROMPTS, 20, CostModel.forcing(15, 3, widths), tree=15)  # warm-up
    with count_compilations() as compiled:
        for w in widths:
            st = run_auto_tree(dense, d, PROMPTS, 20, CostModel.forcing(15, w, widths), tree=15)
            assert outputs(st) == want, w
            counted = np.asarray(st.speculative.widths)
            assert counted.shape == (16,) and counted[w] == int(st.steps) == counted.sum(), (w, counted)
        chooses = CostModel(step_cost=((1.3, 1.5, 1.9),), plain_cost=(1.0,), widths=widths)
        st = run_auto_tree(dense, d, PROMPTS, 20, chooses, tree=15)
        assert outputs(st) == want
        st = run_auto_tree(dense, d, PROMPTS, 20, CostModel.never_pays(15, widths), tree=15)
        assert outputs(st) == want and int(np.asarray(st.speculative.widths).sum()) < int(st.steps)
    assert compiled() == 0


def test_auto_over_a_tree_samples_the_target_s_own_tokens(dense):
    """At T > 0 a seeded row under auto over a tree commits exactly the tokens plain sampling with
    that seed commits (every committed token is the target's own draw with the row's key)."""
    from dflash_jax.decode.auto.costs import CostModel

    d = tiny_drafter(dense[0], seed=0, block_size=4, layer_ids=(0, 2))
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    cfg, params = dense
    static, w = Decoding(cfg), Params(params)
    plain = decode.decode_loop(w, decode.prefill(w, decode.init_state(static, PROMPTS, 64, 16, seed=7, sampling=sampling), static, 4), static)
    chooses = CostModel(step_cost=((1.3, 1.6),), plain_cost=(1.0,), widths=(3, 7))
    assert outputs(run_auto_tree(dense, d, PROMPTS, 16, chooses, sampling=sampling, seed=7)) == outputs(plain)


def test_expected_tokens_of_a_tree_follow_its_paths():
    """``tree_expected_tokens`` against a hand count: a top candidate is right with the calibrated
    acceptance ``a`` of its slot, another with ``(1 - a) * p / (1 - c)``; a node counts with the
    product along its path. A chain of top candidates gives ``expected_tokens``."""
    from dflash_jax.decode.auto.costs import CostModel, depth_policy
    from dflash_jax.decode.auto import policy as depth
    from dflash_jax.decode.auto.policy import Calibration

    probs = np.array([[0.6, 0.3, 0.05, 0.05], [0.02, 0.03, 0.9, 0.05]])
    lg = jnp.asarray(np.log(probs)[None], jnp.float32)
    _, tree = build_tree(lg, 4)  # a (0.6), a>c (0.54), b (0.3), b>c (0.27)
    policy = depth_policy(Calibration((1.0, 1.0), (0.5, -0.5)), CostModel.forcing(4, 4, (3, 4)), depth=2)
    conf = jnp.asarray([[0.6, 0.9]], jnp.float32)
    a1 = 1 / (1 + np.exp(-(np.log(0.6 / 0.4) + 0.5)))
    a2 = 1 / (1 + np.exp(-(np.log(0.9 / 0.1) - 0.5)))
    b = (1 - a1) * 0.3 / 0.4
    want = np.cumsum([1.0, a1, a1 * a2, b, b * a2])
    got = depth.tree_expected_tokens(policy, tree, conf, jnp.asarray([2], jnp.int32))
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5)
    short = depth.tree_expected_tokens(policy, tree, conf, jnp.asarray([1], jnp.int32))  # depth 2 may not be accepted
    np.testing.assert_allclose(np.asarray(short[0]), np.cumsum([1.0, a1, 0.0, b, 0.0]), rtol=1e-5)
    chain = make_tree([0, 1], [1, 2])._replace(prob=jnp.asarray([[0.6, 0.9]]), rank=jnp.zeros((1, 2), jnp.int32))
    np.testing.assert_allclose(np.asarray(depth.tree_expected_tokens(policy, chain, conf, jnp.asarray([2], jnp.int32))),
                               np.asarray(depth.expected_tokens(policy, conf, jnp.asarray([2], jnp.int32))), rtol=1e-6)


def test_generate_drafts_the_recorded_tree_and_tree_0_a_chain(dense, tmp_path, monkeypatch):
    """The API: a drafter recorded with ``auto`` over a tree (``dflash_jax.tree`` in its
    config.json) drafts that tree by default, its costs kept apart from a chain's; ``tree=0`` drafts
    a chain, a fixed ``n_max`` a chain unless ``tree`` is given; every output equals plain greedy;
    bad trees and bad records are named."""
    import json

    import dflash_jax as dj
    from dflash_jax.decode.auto import costs
    from dflash_jax.serve.jobs import ServedModel
    from dflash_jax.train.export import export_drafter

    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(costs, "STABLE", 100.0)  # the tiny pair's steps take a millisecond: timer noise
    cfg, params = dense
    dcfg, dparams = tiny_drafter(cfg, seed=0, block_size=4, layer_ids=(0, 2))
    target = dj.Target(cfg=cfg, params=params, tokenizer=None, source="tiny-target", eos_ids=())
    export_drafter(tmp_path / "d", dcfg, dparams, dtype="float32")
    record = json.loads((tmp_path / "d" / "config.json").read_text())
    record["dflash_jax"] = dict(n_max="auto", auto_depth=2, tree=3)
    (tmp_path / "d" / "config.json").write_text(json.dumps(record))
    drafter = dj.load_drafter(tmp_path / "d", target)
    assert (drafter.n_max, drafter.auto_depth, drafter.tree) == ("auto", 2, 3)
    want = dj.generate(target, PROMPTS, max_new_tokens=12).output_ids
    res = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter)
    assert res.output_ids == want and res.stats["tree"] == 3 and res.stats["cost_widths"] == [3] and len(res.stats["widths"]) == 4
    chain = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter, tree=0)
    assert chain.output_ids == want and chain.stats["tree"] is None and chain.stats["cost_widths"] == [1, 2]
    kept = sorted(json.loads(f.read_text())["key"].get("tree", 0) for f in (tmp_path / "cache" / "depth_costs").glob("*.json"))
    assert kept == [0, 3]  # a tree's costs and a chain's, each kept under its own key
    fixed = dj.generate(target, PROMPTS, max_new_tokens=12, drafter=drafter, n_max=3)
    assert fixed.output_ids == want and fixed.stats["tree"] is None
    served = ServedModel(target, drafter)
    assert served.decoding().tree == 3 and served.decoding(2).tree is None
    assert ServedModel(target, drafter, tree=0).decoding().tree is None
    for kw, match in ((dict(tree=-1), r"^tree \(--tree\): got -1"), (dict(tree=16), r"\[1, 15\]"), (dict(tree=2.0), "got 2.0"),
                      (dict(tree=3, draft_mode="sample"), "draft_mode='argmax'")):
        with pytest.raises(DFlashError, match=match):
            dj.generate(target, PROMPTS, max_new_tokens=4, drafter=drafter, **kw)
    with pytest.raises(DFlashError, match="without a drafter"):
        dj.generate(target, PROMPTS, max_new_tokens=4, tree=3)
    record["dflash_jax"]["tree"] = 0
    (tmp_path / "d" / "config.json").write_text(json.dumps(record))
    with pytest.raises(DFlashError, match=r"config.json: field dflash_jax.tree: got 0 \(expected an integer in \[1, 15\]"):
        dj.load_drafter(tmp_path / "d", target)


def test_continuous_batching_with_trees_answers_as_plain_greedy(dense):
    """``generate_until`` with a fixed tree and under auto over a tree stops once a row is done;
    that row, given a new prompt with ``replace_rows`` (its drafter context and statistics swapped
    with it), and the rows that kept running answer as plain greedy decoding."""
    from dflash_jax.decode.auto.costs import CostModel, depth_policy
    from dflash_jax.decode.auto.policy import Calibration

    (cfg, params), d = dense, tiny_drafter(dense[0], seed=0, block_size=4, layer_ids=(0, 2))
    want = plain_greedy(dense, [PROMPTS[1], PROMPTS[1], PROMPTS[2]], 20)
    for static in (Decoding(cfg, d[0], n_max=3, tree=5), Decoding(cfg, d[0], n_max="auto", tree=7)):
        policy = None
        if static.adaptive:
            policy = depth_policy(Calibration((0.0,) * 3, (1.4,) * 3), CostModel(step_cost=((1.3, 1.6),), plain_cost=(1.0,), widths=(3, 7)), depth=3)
        w = Params(params, d[1], policy)
        st = decode.prefill(w, decode.init_state(static, PROMPTS, 64, [6, 20, 20]), static, 4)
        st = decode.generate_until(w, st, static, jnp.int32(1))
        assert bool(st.done[0]) and outputs(st)[0] == plain_greedy(dense, PROMPTS, 6)[0]
        fresh = decode.prefill(w, decode.init_state(static, [PROMPTS[1]], 64, 20), static, 4)
        st = decode.decode_loop(w, decode.replace_rows(st, fresh, jnp.asarray([0], jnp.int32)), static)
        assert outputs(st) == want, static
