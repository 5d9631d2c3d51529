"""The ``[out, in]`` weight copies (:mod:`dflash_jax.nn.params`): the same logits within float32
tolerance and the same greedy tokens as without them, read exactly from their row thresholds on,
invisible to fingerprints and sharding, and held by the loaded default target as measured."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.loading import with_output_head
from dflash_jax.families.dense import model as dense
from dflash_jax.nn.params import unstack_layers
from dflash_jax.nn.params import PerLayer
from dflash_jax.nn import params as layouts
from dflash_jax.testing import reference_greedy, tiny_drafter, tiny_target

PROMPT = [5, 9, 17, 3, 22, 8, 1]


@pytest.fixture(scope="module")
def pair():
    cfg, params = tiny_target()
    params = with_output_head(unstack_layers(params))
    return cfg, params, layouts.with_wide_layouts(params)


def _logits(params, cfg, b, t):
    tokens = jnp.asarray(np.arange(b * t).reshape(b, t) % 50 + 3, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return np.asarray(dense.MODEL.forward(params, cfg, tokens, positions, dense.MODEL.init_cache(cfg, b, 16))[0])


@pytest.mark.parametrize("b,t", [(1, 1), (1, 2), (1, 3), (2, 4)])
def test_copies_give_the_loaded_weights_logits(pair, b, t):
    cfg, params, wide = pair
    assert {"w_gate_t", "w_up_t"} <= set(wide["layers"][0]) and wide["lm_head_t"].shape == params["embed"].shape
    np.testing.assert_allclose(_logits(wide, cfg, b, t), _logits(params, cfg, b, t), rtol=1e-5, atol=1e-5)


def test_copies_are_used_from_their_row_thresholds_on(pair):
    """Zeroed copies change the logits exactly where the thresholds say they are read."""
    cfg, params, wide = pair
    no_mlp = dict(wide, layers=PerLayer(dict(lp, w_gate_t=jnp.zeros_like(lp["w_gate_t"])) for lp in wide["layers"]))
    no_head = dict(wide, lm_head_t=jnp.zeros_like(wide["lm_head_t"]))
    for rows, t in ((1, 1), (2, 2), (3, 3)):
        ref = _logits(params, cfg, 1, t)
        assert np.allclose(_logits(no_mlp, cfg, 1, t), ref, atol=1e-5) == (rows < layouts.GATE_UP_MIN_ROWS)
        assert np.allclose(_logits(no_head, cfg, 1, t), ref, atol=1e-5) == (rows < layouts.HEAD_MIN_ROWS)


def test_greedy_decoding_with_copies_equals_the_reference(pair):
    """Plain and DFlash greedy decoding over the copies (DFlash's verify passes have several rows,
    so they read them) give the tokens of the cache-free reference over the weights as loaded."""
    cfg, params, wide = pair
    want = reference_greedy(params, cfg, PROMPT, 10)
    target = dj.Target(cfg=cfg, params=wide, tokenizer=None, source="tiny-target", eos_ids=())
    dcfg, dparams = tiny_drafter(cfg)
    drafter = dj.Drafter(cfg=dcfg, params=dparams, source="tiny-drafter")
    assert dj.generate(target, [PROMPT], max_new_tokens=10).output_ids[0] == want
    for n_max in (1, 3):
        assert dj.generate(target, [PROMPT], max_new_tokens=10, drafter=drafter, n_max=n_max).output_ids[0] == want


def test_unknown_kind_is_named(pair):
    with pytest.raises(ValueError, match="kinds"):
        layouts.with_wide_layouts(pair[1], ("wq",))


def test_a_tied_head_without_lm_head_gets_no_copy():
    cfg, params = tiny_target()
    assert "lm_head" not in params and "lm_head_t" not in layouts.with_wide_layouts(params)
    assert jax.tree_util.tree_structure(layouts.with_wide_layouts(params, ())) == jax.tree_util.tree_structure(params)


def test_fingerprints_and_sharding_see_through_the_copies(pair):
    """The copies are a layout, not weights: fingerprints equal the tree's without them, and
    ``param_shardings`` places each copy (and the tied head's ``lm_head``) by its weight's axes, swapped."""
    from dflash_jax.runtime import sharding as shd
    from dflash_jax.runtime.fingerprint import tree_fingerprint, weights_fingerprint

    cfg, params, wide = pair
    assert tree_fingerprint(wide) == tree_fingerprint(params) != tree_fingerprint(dict(params, lm_head=params["lm_head"] * 2))
    assert weights_fingerprint(cfg, wide) == weights_fingerprint(cfg, params)
    axes = layouts.with_wide_axes(dense.MODEL.param_axes(cfg, per_layer=True), wide)
    assert axes["lm_head"] == ("embed", "vocab") and axes["lm_head_t"] == ("vocab", "embed")
    assert axes["layers"][0]["w_gate_t"] == ("mlp", "embed")
    shardings = shd.param_shardings(wide, dense.MODEL.param_axes(cfg, per_layer=True), shd.make_mesh())
    assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(wide)


def test_the_loaded_default_target_holds_the_cpu_copies():
    """On the CPU backend the default target holds :data:`layouts.CPU_KINDS`; tied, its head copy is
    the embedding itself (no second buffer)."""
    target = dj.load_target()
    assert layouts.CPU_KINDS == ("lm_head",) and target.params["lm_head_t"] is target.params["embed"]
    assert "w_gate_t" not in target.params["layers"][0]
