"""Reduced draft vocabulary (dflash_jax/drafter/vocab.py): id lists, drafting, exact verification,
the training objective, export/load and sharding.

Oracles: hand-counted frequencies and coverage, the target's own greedy decode, the same run with
the full vocabulary (``ids = arange(V)``), argmax / softmax over the listed columns of the
full-vocabulary drafter logits computed by hand, an exact enumerated target distribution
(chi-square) and a numpy cross-entropy over the listed columns.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_spec import PROMPTS, assert_follows_target, drafter_for, outputs, plain_greedy, run_spec, target  # noqa: F401
from test_train import GAMMA, _loss_terms, make_batch, models  # noqa: F401

from dflash_jax import loading
from dflash_jax.drafter import vocab as dv
from dflash_jax.runtime import sharding as shd
from dflash_jax.decode import loop as decode
from dflash_jax.decode import step as speculative
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.errors import DFlashError
from dflash_jax.drafter import model as drafter
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.testing import tiny_drafter, tiny_target
from dflash_jax.train import objective
from dflash_jax.train.export import export_drafter
from dflash_jax.families.registry import module_for

# prompt tokens (mask 0) 9 x4; supervised counts: 3 x3, 7 x2, 1 x2, 5 x1
TOKENS = np.array([9, 9, 9, 9, 3, 7, 3, 1, 7, 5, 1, 3])
MASK = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
SMALL_IDS = [0, 5, 17, 40, 99]  # omits most of the 128 tokens


def with_vocab(target, d, ids):
    """The drafter ``d`` drafting over ``ids`` of ``target``'s head."""
    return dv.attach(d[0], d[1], target[1], np.asarray(ids, np.int32))


# ------------------------------------------------------------------------------ id lists


def test_most_frequent_counts_supervised_tokens_only():
    for size, want in ((1, [3]), (2, [1, 3]), (3, [1, 3, 7]), (4, [1, 3, 5, 7]), (5, [0, 1, 3, 5, 7])):
        got = dv.most_frequent(TOKENS, MASK, size, 10)  # 7 and 1 tie: the smaller id first; then 0 (count 0)
        assert got.dtype == np.int32 and got.tolist() == want, size
    assert dv.most_frequent(TOKENS, MASK, 10, 10).tolist() == list(range(10))
    for size in (0, 11, -1):
        with pytest.raises(DFlashError, match="--draft-vocab"):
            dv.most_frequent(TOKENS, MASK, size, 10)


@pytest.mark.parametrize("ids", [[3, 1], [1, 1, 2], [-1, 2], [2, 10], [[1, 2]], [], [0.0, 1.0]])
def test_check_ids_refuses_bad_lists(ids):
    with pytest.raises(DFlashError, match="where-it-was"):
        dv.check_ids(np.asarray(ids), 10, "where-it-was")


def test_check_ids_save_load_roundtrip(tmp_path):
    ok = dv.check_ids(np.array([0, 4, 9], np.int64), 10, "x")
    assert ok.dtype == np.int32 and ok.tolist() == [0, 4, 9]
    assert dv.load(tmp_path, 10) is None
    dv.save(tmp_path, ok)
    back = dv.load(tmp_path, 10)
    assert back.dtype == np.int32 and back.tolist() == [0, 4, 9]
    with pytest.raises(DFlashError, match=dv.FILE_NAME):  # valid file, ids outside a smaller vocabulary
        dv.load(tmp_path, 9)
    from safetensors.numpy import save_file

    save_file({"ids": np.array([1, 2], np.int32)}, str(tmp_path / dv.FILE_NAME))
    with pytest.raises(DFlashError, match=f"{dv.FILE_NAME}.*draft_ids"):
        dv.load(tmp_path, 10)
    full = (tmp_path / dv.FILE_NAME).read_bytes()
    for junk in (b"not a safetensors file", full[: len(full) // 2]):  # corrupt, truncated
        (tmp_path / dv.FILE_NAME).write_bytes(junk)
        with pytest.raises(DFlashError, match=f"{dv.FILE_NAME}.*unreadable safetensors"):
            dv.load(tmp_path, 10)


def test_coverage_by_hand():
    assert dv.coverage([1, 3], TOKENS, MASK) == pytest.approx(5 / 8)  # 3 x3 + 1 x2 of 8 supervised
    assert dv.coverage([9], TOKENS, MASK) == 0.0  # 9 is only in the prompt
    assert dv.coverage([9], TOKENS, np.zeros_like(MASK)) == 1.0


# ------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("ids", [np.arange(0, 128, 2), SMALL_IDS], ids=["even", "small"])
def test_greedy_lossless_with_draft_vocab(target, ids):
    d = with_vocab(target, drafter_for(target[0], 4, seed=5), ids)
    assert d[0].draft_vocab_size == len(ids)
    assert outputs(run_spec(target, d, PROMPTS, 20)) == plain_greedy(target, PROMPTS, 20)


@pytest.fixture(scope="module")
def small():
    """An 8-token target (its head stored as ``lm_head``) and a random drafter that gets tokens accepted."""
    cfg, params = tiny_target("llama", seed=11, vocab_size=8, scale=0.5)
    return (cfg, loading.with_output_head(params)), tiny_drafter(cfg, seed=1, block_size=4, layer_ids=(0, 2), scale=0.5)


@pytest.mark.slow
def test_whole_vocab_list_changes_nothing(small):
    target, d = small
    prompts = [[1, 5, 2], [3, 3, 0, 6], [2]]
    a = run_spec(target, d, prompts, 20)
    b = run_spec(target, with_vocab(target, d, np.arange(8)), prompts, 20)
    assert int(np.asarray(a.speculative.accepted).sum()) > 5, "the drafter should get tokens accepted"
    assert outputs(a) == outputs(b) == plain_greedy(target, prompts, 20)
    for name in ("verify_steps", "drafted", "accepted", "accepted_per_position"):
        np.testing.assert_array_equal(np.asarray(getattr(a.speculative, name)), np.asarray(getattr(b.speculative, name)), err_msg=name)
    np.testing.assert_array_equal(np.asarray(a.committed), np.asarray(b.committed), err_msg="committed")
    c = run_spec(target, with_vocab(target, d, [0, 2, 3, 5]), prompts, 20)
    assert outputs(c) == outputs(a) and int(np.asarray(c.speculative.accepted).sum()) > 0


def _prefilled_and_full_logits(target, d):
    """A spec state after prefilling PROMPTS and the full-vocabulary draft logits ``[B, W-1, V]``
    of its next block, computed directly with the drafter."""
    cfg, params = target
    dcfg, dparams = d
    st = decode.prefill(Params(params, dparams), decode.init_state(Decoding(cfg, dcfg), PROMPTS, 64, 8), Decoding(cfg, dcfg), 4)
    start = np.asarray(st.length) - 1
    w = dcfg.block_size
    anchor = np.asarray(st.tokens)[np.arange(len(PROMPTS)), start]
    block = jnp.asarray([[int(a)] + [dcfg.mask_token_id] * (w - 1) for a in anchor], jnp.int32)
    pos = jnp.asarray(start[:, None] + np.arange(w), jnp.int32)
    h = drafter.forward(dparams, dcfg, module_for(cfg), params, cfg, block, pos, st.speculative.ctx_k, st.speculative.ctx_v, jnp.asarray(start, jnp.int32))
    return st, np.asarray(drafter.logits(dparams, dcfg, module_for(cfg), params, cfg, h[:, 1:]))


def test_argmax_drafts_are_the_best_listed_token(target):
    cfg, params = target
    d = drafter_for(cfg, 4, seed=7)
    st, full = _prefilled_and_full_logits(target, d)
    ids = np.array(SMALL_IDS)
    dcfg, dparams = with_vocab(target, d, ids)
    drafts, _ = speculative.propose_block(Params(params, dparams), st, Decoding(cfg, dcfg))
    want = ids[np.argmax(full[..., ids], axis=-1)]
    np.testing.assert_array_equal(np.asarray(drafts), want)
    assert (want != np.argmax(full, axis=-1)).any()  # the restriction matters here


def test_sampled_drafts_are_listed_tokens_drawn_with_the_target_ids_uniform(target):
    """A sampled draft is the inverse-transform draw, with the uniform of the draft's position, from
    the warped drafter distribution laid out over the target's vocabulary (zero off the list); a
    greedy row of the same batch drafts the best listed token, as a target id."""
    from dflash_jax.decode.sampling import RowSampling, uniform_at

    cfg, params = target
    d = drafter_for(cfg, 4, seed=7)
    st, full = _prefilled_and_full_logits(target, d)
    ids = np.array(SMALL_IDS)
    dcfg, dparams = with_vocab(target, d, ids)
    st = st.replace(sampling=RowSampling.of([SamplingConfig(0.7)] * (len(PROMPTS) - 1) + [SamplingConfig()], len(PROMPTS)))
    drafts, _ = speculative.propose_block(Params(params, dparams), st, Decoding(cfg, dcfg, draft_mode="sample"))
    index = np.asarray(st.length)[:, None] + np.arange(full.shape[1])  # the mask at position p drafts the token at index p
    u = np.asarray(uniform_at(st.rng, jnp.asarray(index, jnp.int32)), np.float64)
    z = full[..., ids].astype(np.float64) / 0.7
    q = np.zeros(full.shape)
    q[..., ids] = np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
    want = np.sum(np.cumsum(q, axis=-1) <= u[..., None], axis=-1)
    want[-1] = ids[np.argmax(full[-1][..., ids], axis=-1)]  # the greedy row
    np.testing.assert_array_equal(np.asarray(drafts), want)
    assert set(want.ravel()) <= set(ids.tolist())


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3)], ids=["t1", "t0.8-k3"])
def test_sampled_tokens_follow_target_distribution_with_draft_vocab(sampling):
    """As test_spec's chi-square test, in draft_mode="sample" with a drafter listing only 4 of
    the 8 tokens (tied head: the columns come from the embedding)."""
    cfg, params = tiny_target("llama", seed=11, vocab_size=8, scale=0.5)
    ids = [0, 2, 3, 5]
    d = with_vocab((cfg, params), tiny_drafter(cfg, seed=1, block_size=4, layer_ids=(0, 2), scale=0.5), ids)
    prompt, n = [1, 5, 2], 6000
    st = run_spec((cfg, params), d, [prompt] * n, 3, chunk=4, max_len=8, sampling=sampling, seed=123, mode="sample")
    assert (np.asarray(st.length) == 6).all()
    assert int(np.asarray(st.speculative.accepted).sum()) > n // 20, "the drafter should get some tokens accepted"
    joint = assert_follows_target(cfg, params, prompt, sampling, np.asarray(st.tokens[:, 3:6]))
    assert 1 - joint[np.ix_(ids, ids, ids)].sum() > 0.2, "the target should often emit tokens outside the list"


# ------------------------------------------------------------------------------ training objective


def _terms(models, batch, anchors, ids=None, cfg=None):
    t_cfg, t_params, d_cfg, d_params = models
    tokens, mask, feats = batch
    ids = None if ids is None else jnp.asarray(ids, jnp.int32)
    return _loss_terms(d_params, cfg or d_cfg, t_params, t_cfg, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(feats),
                       jnp.asarray(anchors, jnp.int32), jnp.ones(np.shape(anchors), bool), GAMMA, ids)


def test_listed_logits_are_the_full_logits_columns_on_a_soft_capped_family():
    """On a Gemma 4 target (final-logit soft-cap 5) the drafter's logits over a draft vocabulary are
    the listed columns of its full-vocabulary logits: the reduced head runs through the family's
    ``lm_head``, cap included (the raw logits reach well past the cap here), untied or tied."""
    from test_families import TINY_HF

    from dflash_jax.families import registry
    from dflash_jax.nn.layer import lm_head

    fam = next(f for f in registry.TARGET_FAMILIES if f.name == "gemma4")
    cfg = fam.parse_hf(TINY_HF["gemma4"], "gemma4/config.json")
    assert cfg.final_logit_softcapping == 5.0
    dcfg, dparams = tiny_drafter(cfg, seed=1, layer_ids=(0, 2), block_size=4)
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 3, cfg.hidden_size)) * 4, jnp.float32)
    head = jnp.asarray(rng.normal(size=(cfg.hidden_size, cfg.vocab_size)) * 0.3, jnp.float32)
    ids = np.array([0, 5, 17, 40, 63])
    for params in ({"lm_head": head}, {"embed": head.T}):  # the logits read only the target's head
        full = np.asarray(drafter.logits(dparams, dcfg, module_for(cfg), params, cfg, hidden))
        rcfg, rparams = dv.attach(dcfg, dparams, params, ids)
        got = np.asarray(drafter.logits(rparams, rcfg, module_for(cfg), params, cfg, hidden))
        np.testing.assert_allclose(got, full[..., ids], rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(lm_head(params, cfg, hidden))[..., ids]).max() > 10


def test_loss_over_the_whole_vocab_list_equals_the_plain_loss(models):
    batch = make_batch([30, 21], 32, seed=1)
    anchors = [[4, 9, 15, 20], [5, 8, 12, 16]]
    a, b = _terms(models, batch, anchors), _terms(models, batch, anchors, np.arange(models[0].vocab_size))
    for k in a:
        np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), rtol=1e-5, atol=1e-5, err_msg=k)


def test_loss_over_a_list_by_hand(models):
    t_cfg, t_params, d_cfg, d_params = models
    d_cfg = dataclasses.replace(d_cfg, output_multiplier=0.7)
    tokens, mask, feats = batch = make_batch([30], 32, seed=2)
    w = d_cfg.block_size
    anchors = np.array([[4, 10, 17, 22]])
    ids = np.unique(tokens[0, 4:30])[::2]  # about half of the labels fall outside the list
    got = _terms((t_cfg, t_params, d_cfg, d_params), batch, anchors, ids, d_cfg)
    blk, pos = objective.block_inputs(jnp.asarray(tokens), jnp.asarray(anchors), w, d_cfg.mask_token_id)
    hid = objective.block_hidden(d_params, d_cfg, t_params, t_cfg, jnp.asarray(feats), blk, pos, jnp.asarray(anchors))
    lg = np.einsum("nwh,vh->nwv", np.asarray(hid[0], np.float64), np.asarray(t_params["embed"], np.float64)[ids]) * 0.7
    index = {int(t): i for i, t in enumerate(ids)}
    for j, a in enumerate(anchors[0]):
        ce = wsum = accept = 0.0
        run = True
        for k in range(1, w):
            p, wk = a + k, np.exp(-(k - 1) / GAMMA)
            sup = p < 32 and mask[0, p] > 0
            i = index.get(int(tokens[0, p]), -1) if sup else -1
            if i >= 0:
                ce += wk * (np.logaddexp.reduce(lg[j, k]) - lg[j, k, i])
                wsum += wk
            run = run and i >= 0 and int(np.argmax(lg[j, k])) == i
            accept += run
        np.testing.assert_allclose(float(got["ce"][0, j]), ce, rtol=2e-5, atol=1e-5)
        np.testing.assert_allclose(float(got["weight"][0, j]), wsum, rtol=1e-6)
        assert float(got["accept"][0, j]) == accept
    assert float(got["weight"].sum()) < 0.9 * float(_terms(models, batch, anchors)["weight"].sum())


def test_out_of_list_label_is_a_miss(models):
    """With a one-token list the argmax is always that token: labels x, y, x, ... accept 1 slot
    (y is outside the list, a miss even though every argmax index is 0)."""
    tokens, mask, feats = make_batch([32], 32, prompt=0, seed=3)
    a, x, y = 8, 0, 1
    tokens[0, a + 1 : a + 8] = [x, y, x, x, x, x, x]
    t = _terms(models, (tokens, mask, feats), [[a]], [x])
    assert float(t["accept"][0, 0]) == 1.0
    wk = np.exp(-np.arange(7) / GAMMA)
    np.testing.assert_allclose(float(t["correct"][0, 0]), wk.sum() - wk[1], rtol=1e-6)
    np.testing.assert_allclose(float(t["weight"][0, 0]), wk.sum() - wk[1], rtol=1e-6)
    assert abs(float(t["ce"][0, 0])) < 1e-5  # a one-column softmax is certain


# ------------------------------------------------------------------------------ export, load, sharding


def test_export_writes_the_list_and_load_drafter_attaches_it(tmp_path, models):
    t_cfg, t_params, d_cfg, d_params = models
    tgt = loading.Target(cfg=t_cfg, params=t_params, source="tiny")
    ids = np.array([1, 4, 9, 30, 126], np.int32)
    folder = export_drafter(tmp_path / "d", d_cfg, d_params, dtype="float32", draft_ids=ids)
    assert dv.load(folder, t_cfg.vocab_size).tolist() == ids.tolist()
    got = loading.load_drafter(folder, tgt)
    assert got.cfg == dataclasses.replace(d_cfg, draft_vocab_size=len(ids))
    np.testing.assert_array_equal(np.asarray(got.params["draft_ids"]), ids)
    np.testing.assert_array_equal(np.asarray(got.params["draft_head"]), np.asarray(t_params["embed"])[ids].T)
    plain = loading.load_drafter(folder, tgt, draft_vocab=False)
    assert plain.cfg == d_cfg and "draft_head" not in plain.params and "draft_ids" not in plain.params
    export_drafter(folder, d_cfg, d_params, dtype="float32")
    assert not (folder / dv.FILE_NAME).exists() and loading.load_drafter(folder, tgt).cfg.draft_vocab_size == 0
    with pytest.raises(DFlashError, match="draft_ids"):
        export_drafter(folder, d_cfg, d_params, draft_ids=[4, 1])


def test_param_tree_and_sharding_with_draft_vocab(target):
    d = with_vocab(target, drafter_for(target[0], 4), SMALL_IDS)
    dcfg, dparams = d
    shapes = drafter.param_shapes(dcfg)
    assert shapes["draft_ids"] == (5,) and shapes["draft_head"] == (dcfg.hidden_size, 5)
    assert jax.tree.map(np.shape, dparams) == jax.tree.map(tuple, shapes, is_leaf=lambda s: isinstance(s, tuple))
    init = drafter.init_params(dcfg, jax.random.key(0))
    assert jax.tree.structure(init) == jax.tree.structure(dparams) and np.asarray(init["draft_ids"]).tolist() == list(range(5))
    mesh = shd.make_mesh()
    placed = shd.shard_params(dparams, drafter.param_axes(dcfg), mesh)
    assert jax.tree.structure(placed) == jax.tree.structure(dparams)
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(dparams)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert placed["draft_head"].sharding.spec == jax.sharding.PartitionSpec(None, None)
    with pytest.raises(DFlashError, match="does not match"):
        shd.shard_params(dparams, drafter.param_axes(drafter_for(target[0], 4)[0]), mesh)
