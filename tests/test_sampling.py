"""Sampling warps against a NumPy statement of the HF rules, and empirical frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.errors import DFlashError
from dflash_jax.sampling import SamplingConfig, probabilities, sample, top2_gap


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
    logits = jnp.asarray([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    keys = jax.random.split(jax.random.key(0), 40000)
    draws = np.asarray(jax.vmap(lambda k: sample(k, logits, cfg))(keys))
    freq = np.bincount(draws, minlength=6) / draws.size
    np.testing.assert_allclose(freq, np.asarray(probabilities(logits, cfg)), atol=0.01)


def test_greedy_and_gap():
    logits = jnp.asarray([[0.1, 3.0, 2.5], [4.0, 1.0, 3.9]])
    assert list(np.asarray(sample(None, logits, SamplingConfig()))) == [1, 0]
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
    assert str(e.value).startswith(opt + ": ") and "(expected " in str(e.value)


def test_numpy_scalars_are_accepted():
    assert SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9)).top_k == 3
