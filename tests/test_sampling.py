"""Sampling warps against a NumPy statement of the HF rules, and empirical frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.decode.sampling import (
    RowSampling,
    SamplingConfig,
    probabilities,
    row_keys,
    sample_at,
    top2_gap,
    warp_logits,
)


def np_reference(logits, t, k, p):
    x = logits / t
    if k:
        kth = np.sort(x)[::-1][k - 1]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p < 1:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = np.zeros_like(probs, bool)
        keep[order[(cum - probs[order]) < p]] = True
        probs = np.where(keep, probs, 0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.5)])
def test_probabilities_match_reference(t, k, p):
    logits = np.random.RandomState(0).randn(16).astype(np.float32) * 2
    got = np.asarray(probabilities(jnp.asarray(logits), SamplingConfig(t, k, p)))
    np.testing.assert_allclose(got, np_reference(logits.astype(np.float64), t, k, p), atol=1e-6)


def test_sample_frequencies_follow_probabilities():
    """Draws at 200 positions of 200 rows follow the warped distribution, and the draws of
    neighbouring positions are independent (their joint frequencies are the products)."""
    logits = jnp.asarray([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    index = jnp.broadcast_to(jnp.arange(200, dtype=jnp.int32), (200, 200))
    draws = np.asarray(sample_at(row_keys(0, 200), index, jnp.broadcast_to(logits, (200, 200, 6)), cfg))
    p = np.asarray(probabilities(logits, cfg))
    np.testing.assert_allclose(np.bincount(draws.ravel(), minlength=6) / draws.size, p, atol=0.01)
    joint = np.bincount((6 * draws[:, :-1] + draws[:, 1:]).ravel(), minlength=36).reshape(6, 6) / draws[:, 1:].size
    np.testing.assert_allclose(joint, np.outer(p, p), atol=0.01)


def test_row_keys_are_per_row_and_a_seed_list_keeps_each_seed():
    """Rows of one seed get distinct keys; in a list of seeds each row gets row 0's key of its
    own seed (a server request samples as it would alone), and the list's length must match."""
    data = lambda k: np.asarray(jax.random.key_data(k)).tolist()
    keys = row_keys(9, 4)
    assert keys.shape == (4,) and len({str(d) for d in data(keys)}) == 4
    assert data(row_keys([5, 9], 2))[1] == data(row_keys(9, 3))[0] == data(keys)[0]
    assert data(row_keys(jax.random.key(9), 4)) == data(keys)
    with pytest.raises(DFlashError, match="one seed per prompt"):
        row_keys([1, 2], 3)


def test_greedy_and_gap():
    logits = jnp.asarray([[0.1, 3.0, 2.5], [4.0, 1.0, 3.9]])
    assert np.asarray(sample_at(None, jnp.zeros((2, 1), jnp.int32), logits[:, None], SamplingConfig()))[:, 0].tolist() == [1, 0]
    np.testing.assert_allclose(np.asarray(top2_gap(logits)), [0.5, 0.1], atol=1e-6)


@pytest.mark.parametrize("kw,opt", [({"temperature": -1}, "--temperature"), ({"top_k": -2}, "--top-k"), ({"top_p": 0.0}, "--top-p")])
def test_bad_settings_name_the_option(kw, opt):
    with pytest.raises(DFlashError, match=opt):
        SamplingConfig(**kw)


@pytest.mark.parametrize(
    "kw,opt",
    [
        (dict(temperature=float("nan")), "--temperature"),
        (dict(temperature=float("inf")), "--temperature"),
        (dict(top_p=float("nan")), "--top-p"),
        (dict(temperature=1.0, top_p=float("inf")), "--top-p"),
        (dict(temperature="1"), "--temperature"),
        (dict(top_k=2.5), "--top-k"),
        (dict(top_k=True), "--top-k"),
    ],
)
def test_non_finite_and_mistyped_values_are_refused(kw, opt):
    with pytest.raises(DFlashError) as e:
        SamplingConfig(**kw)
    # the API's argument, then the command line's option (which the command line reports alone)
    assert str(e.value).startswith(f"{opt[2:].replace('-', '_')} ({opt}): ") and "(expected " in str(e.value)


def test_numpy_scalars_are_accepted():
    assert SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9)).top_k == 3


@pytest.mark.parametrize("u, want", [(0.0, 1), (1 - 2**-24, 3)])
def test_the_draw_never_picks_a_token_of_probability_zero(monkeypatch, u, want):
    """At the ends of the uniform's range the inverse transform picks the first / last token of
    positive probability (here top-k leaves tokens 1 and 3 of 6), whatever the float rounding of
    the cumulative sum."""
    import dflash_jax.decode.sampling as sampling

    monkeypatch.setattr(sampling, "uniform_at", lambda rng, index: jnp.full(index.shape, u, jnp.float32))
    logits = jnp.asarray([[[0.0, 5.0, 1.0, 4.9, -3.0, 2.0]]])
    got = sampling.sample_at(row_keys(0, 1), jnp.zeros((1, 1), jnp.int32), logits, SamplingConfig(1.0, top_k=2))
    assert int(got[0, 0]) == want


ROWS = [SamplingConfig(), SamplingConfig(0.9, top_k=4, top_p=0.8), SamplingConfig(1.3), SamplingConfig(0.7, top_p=0.6)]


def test_row_settings_act_as_each_row_s_own_config():
    """A :class:`RowSampling` mixing a greedy row and rows of each warp gives, row by row, what the
    row's :class:`SamplingConfig` gives, with the same keys and indices: the same warped
    logits and probabilities bit for bit, and the same draw at each of 300 positions (over the
    full vocabulary, and over a draft vocabulary laid out over the target's ids)."""
    b, t, v = len(ROWS), 300, 12
    logits = jnp.asarray(np.random.RandomState(1).randn(b, t, v).astype(np.float32) * 2)
    keys, index = row_keys(7, b), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rows = RowSampling.of(ROWS, b)
    ids = jnp.asarray([1, 3, 4, 6, 8, 9, 10, 12, 15, 16, 18, 19], jnp.int32)  # a draft vocabulary of a 20-token target
    mixed = [warp_logits(logits, rows), probabilities(logits, rows), sample_at(keys, index, logits, rows),
             sample_at(keys, index, logits, rows, vocab=20, ids=ids)]
    for r, cfg in enumerate(ROWS):  # the whole batch under the row's config (XLA:CPU's softmax rounds by shape)
        alone = [warp_logits(logits, cfg), probabilities(logits, cfg), sample_at(keys, index, logits, cfg),
                 sample_at(keys, index, logits, cfg, vocab=20, ids=ids)]
        for name, m, a in zip(("warp", "probabilities", "draw", "draft-vocabulary draw"), mixed, alone):
            np.testing.assert_array_equal(np.asarray(m[r]), np.asarray(a[r]), err_msg=f"{name} of row {r}")
    draws = np.asarray(mixed[2])
    assert (draws[0] == np.argmax(np.asarray(logits[0]), -1)).all() and len(set(draws[2].tolist())) > 4
    assert set(np.asarray(mixed[3][0]).tolist()) <= set(np.asarray(ids).tolist())  # greedy row: target ids too
    assert (np.asarray(mixed[3][0]) == np.asarray(ids)[np.argmax(np.asarray(logits[0]), -1)]).all()
    np.testing.assert_array_equal(np.asarray(warp_logits(logits, RowSampling.of(SamplingConfig(), b))), np.asarray(logits))


def test_row_settings_of_a_wrong_list_are_refused():
    with pytest.raises(DFlashError, match="sampling: 1 settings for 2 rows"):
        RowSampling.of([SamplingConfig()], 2)
    with pytest.raises(DFlashError, match="sampling"):
        RowSampling.of([SamplingConfig(), 0.7], 2)


def _nucleus_by_sort(x, p):
    """The kept set of top-p by a full sort (float64): the tokens at or above the value at which
    the sorted cumulative mass first reaches ``p`` (tokens tied with it kept)."""
    x = x.astype(np.float64)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-x, kind="stable")
    reach = int(np.searchsorted(np.cumsum(probs[order]), p * (1 - 1e-12)))
    return x >= x[order[min(reach, len(x) - 1)]]


def _ties(rs, v):
    """Adversarial logits: few distinct values, many tokens sharing each (the cut falls in a tie)."""
    return rs.choice(np.array([3.0, 1.5, 1.5, 0.0, -1.0, -1.0, -1.0, -20.0], np.float32), v)


@pytest.mark.parametrize("kind", ["random", "peaked", "ties"])
def test_top_p_threshold_search_keeps_the_set_a_sort_keeps(kind):
    """The bisection over the values' bit patterns (no sort) keeps exactly the tokens a full sort
    keeps, on random, peaked and heavily tied distributions, for many p."""
    rs = np.random.RandomState({"random": 1, "peaked": 2, "ties": 3}[kind])
    v = 512
    rows = [(_ties(rs, v) if kind == "ties" else (rs.randn(v) * (6.0 if kind == "peaked" else 1.0))).astype(np.float32)
            for _ in range(24)]
    ps = rs.uniform(0.05, 0.99, len(rows)).astype(np.float32)
    x = jnp.asarray(np.stack(rows))
    warped = np.asarray(warp_logits(x, RowSampling(jnp.ones(len(rows)), jnp.zeros(len(rows), jnp.int32), jnp.asarray(ps))))
    for row, p, got in zip(rows, ps, warped):
        want = _nucleus_by_sort(row, float(p))
        assert np.array_equal(np.isfinite(got), want), (kind, p, np.isfinite(got).sum(), want.sum())
