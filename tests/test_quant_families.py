"""Quantized weights stand in for float ones in every target family and drafter kind: the model
run on Q8_0 :class:`~dflash_jax.nn.quant.QuantizedWeight` leaves gives the logits (and greedy
tokens) of the same model run on the float32 weights those codes stand for; MoE experts exact on
both expert paths (the chosen experts gathered, or the whole stack dequantized); the runtime
(sharding, fingerprints, wide layouts, per-layer layers, a draft vocabulary's head) takes them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafter import model as drafter
from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.families import registry
from dflash_jax.nn import moe, quant
from dflash_jax.nn import params as P
from dflash_jax.runtime import fingerprint, sharding
from dflash_jax.testing import tiny_drafter, tiny_target
from laguna_tiny import LAGUNA_DRAFTER
from quant_tiny import count_quantized, quantize_tree
from test_families import TINY_HF

# input widths that are multiples of 32 (Q8_0 groups), 16 experts (a decode step's pairs < E)
WIDE = dict(hidden_size=64, intermediate_size=64)
OVERRIDES = {
    "laguna": dict(WIDE, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16),
    "qwen3_moe": dict(WIDE, moe_intermediate_size=32, num_experts=16),
    "gpt_oss": dict(WIDE, num_local_experts=16),
    "qwen3_5": dict(WIDE),
    "gemma4": dict(WIDE),
}
SKIP = ()  # leaves kept float (none: the embedding gather and the head take quantized weights too)


def _family(name):
    return next(f for f in registry.TARGET_FAMILIES if f.name == name)


@pytest.fixture(scope="module", params=sorted(OVERRIDES))
def family_case(request):
    fam = _family(request.param)
    cfg = fam.parse_hf(dict(TINY_HF[fam.name], **OVERRIDES[fam.name]), f"{fam.name}/config.json")
    params = fam.model.init_params(cfg, jax.random.key(3), 0.3)
    q, f = quantize_tree(params, skip=SKIP)
    return fam.model, cfg, q, f


def _prefill_then_decode(m, cfg, params):
    b, t, s = 2, 6, 12
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    forward = jax.jit(m.forward, static_argnums=1)
    logits, cache, _ = forward(params, cfg, tokens[:, :5], pos[:, :5], m.init_cache(cfg, b, s))  # 20 pairs: whole stacks
    one, _, _ = forward(params, cfg, tokens[:, 5:], pos[:, 5:], cache)  # one token per row: 4 pairs < 16 experts, gathered
    return logits, one


def test_quantized_targets_equal_the_float_targets_of_their_values(family_case):
    m, cfg, q, f = family_case
    assert count_quantized(q) >= 6
    lq, dq = _prefill_then_decode(m, cfg, q)
    lf, df = _prefill_then_decode(m, cfg, f)
    np.testing.assert_allclose(lq, lf, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dq, df, rtol=1e-4, atol=1e-4)
    assert (np.argmax(lq, -1) == np.argmax(lf, -1)).all() and (np.argmax(dq, -1) == np.argmax(df, -1)).all()


@pytest.mark.parametrize("n", [3, 40])  # 3*2 pairs < 16 experts: gathered; 80 >= 16: whole stack
def test_routed_experts_on_quantized_stacks(n):
    rng = np.random.default_rng(n)
    E, H, I, k = 16, 64, 32, 2
    x = jnp.asarray(rng.normal(size=(n, H)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, E, (n, k)), jnp.int32)
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    stacks = {"e_gate": rng.normal(size=(E, H, I)), "e_up": rng.normal(size=(E, H, I)), "e_down": rng.normal(size=(E, I, H))}
    q, f = quantize_tree({k_: jnp.asarray(v, jnp.float32) for k_, v in stacks.items()})
    assert count_quantized(q) == 3
    biases = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((E, I), (E, I), (E, H)))
    act = moe.clamped_glu(7.0, 1.702)
    run = jax.jit(lambda s: moe.routed_experts(x, idx, w, s["e_gate"], s["e_up"], s["e_down"], biases=biases, act=act))
    np.testing.assert_allclose(run(q), run(f), rtol=1e-5, atol=1e-4)


def _drafter_pass(dcfg, dparams, cfg, tparams):
    model = registry.module_for(cfg)
    K = len(dcfg.target_layer_ids)
    ctx = jnp.asarray(np.random.default_rng(1).normal(size=(1, 5, K * cfg.hidden_size)), jnp.float32)

    @jax.jit
    def go(dparams, tparams):
        k, v = drafter.context_kv(dparams, dcfg, ctx, jnp.arange(5, dtype=jnp.int32)[None])
        m = dcfg.mask_token_id
        block, bpos = jnp.asarray([[3, m, m, m]]), 5 + jnp.arange(4, dtype=jnp.int32)[None]
        h = drafter.forward(dparams, dcfg, model, tparams, cfg, block, bpos, k, v, jnp.asarray([5]))
        return k, h, drafter.logits(dparams, dcfg, model, tparams, cfg, h)

    return go(dparams, tparams)


@pytest.mark.parametrize("kind", ["generic", "generic per layer", "laguna"])
def test_quantized_drafters_equal_the_float_drafters_of_their_values(kind):
    if kind == "laguna":
        from dflash_jax.families.laguna.config import laguna_config_from_hf

        hf = dict(TINY_HF["laguna"], **OVERRIDES["laguna"])
        cfg = laguna_config_from_hf(hf)
        tparams = registry.module_for(cfg).init_params(cfg, jax.random.key(0), 0.3)
        dcfg = drafter.drafter_config_from_hf(dict(LAGUNA_DRAFTER, hidden_size=64, intermediate_size=64))
        dparams = drafter.init_params(dcfg, jax.random.key(1), 0.3)
    else:
        cfg, tparams = tiny_target("qwen3", seed=1)
        dcfg, dparams = tiny_drafter(cfg, seed=2, layer_ids=(0, 2), block_size=4, intermediate_size=64)
        if kind.endswith("per layer"):
            dparams = P.unstack_layers(dparams)
    dq, df = quantize_tree(dparams)
    tq, tf = quantize_tree(tparams, skip=SKIP)
    assert count_quantized(dq) >= 5
    for a, b in zip(_drafter_pass(dcfg, dq, cfg, tq), _drafter_pass(dcfg, df, cfg, tf)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_draft_vocabulary_head_of_a_quantized_target_stays_quantized():
    cfg, params = tiny_target("qwen3", seed=1)
    q, f = quantize_tree(params)
    ids = jnp.asarray([0, 5, cfg.vocab_size - 1], jnp.int32)
    hq, hf = draft_vocab.head_columns(q, ids), draft_vocab.head_columns(f, ids)
    assert quant.is_quantized(hq) and hq.shape == hf.shape == (cfg.hidden_size, 3)
    np.testing.assert_array_equal(hq.dequantized(), hf)
    tied_q, tied_f = quantize_tree({"embed": params["embed"]})
    np.testing.assert_array_equal(draft_vocab.head_columns(tied_q, ids).dequantized(), draft_vocab.head_columns(tied_f, ids))


def test_the_runtime_takes_quantized_leaves(family_case):
    m, cfg, q, f = family_case
    # fingerprint: a quantized tree hashes as the float tree its codes stand for
    assert fingerprint.tree_fingerprint(q) == fingerprint.tree_fingerprint(f)
    assert fingerprint.tree_fingerprint(q, samples=50) == fingerprint.tree_fingerprint(f, samples=50)
    # sharding: every field of a quantized weight gets the axes of its rows
    mesh = sharding.make_mesh()
    shard = sharding.param_shardings(q, m.param_axes(cfg), mesh)
    assert jax.tree_util.tree_structure(shard) == jax.tree_util.tree_structure(q)
    axes = sharding.quantized_axes(m.param_axes(cfg), q)
    leaves = jax.tree_util.tree_leaves(q, is_leaf=quant.is_quantized)
    ax_leaves = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: quant.is_quantized(x) or isinstance(x, tuple))
    for w, ax in zip(leaves, ax_leaves):
        if quant.is_quantized(w):
            assert all(len(a) == v.ndim and a[-1] is None for a, v in zip(ax.fields.values(), w.fields.values()))
    assert sharding.shard_params(q, m.param_axes(cfg), mesh) is not None


def test_wide_layouts_and_per_layer_layers_keep_quantized_weights_quantized():
    cfg, params = tiny_target("qwen3", seed=1)
    q, f = quantize_tree(params)
    wide = P.with_wide_layouts(q)
    assert "lm_head_t" not in wide and not any(k.endswith("_t") for k in wide["layers"])
    assert quant.is_quantized(wide["layers"]["w_gate"])
    per = P.unstack_layers(q)
    assert len(per["layers"]) == cfg.num_hidden_layers and quant.is_quantized(per["layers"][1]["wq"])
    np.testing.assert_array_equal(per["layers"][1]["wq"].dequantized(), f["layers"]["wq"][1])
    back = P.stack_layers(per)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(q)
    assert fingerprint.tree_fingerprint(per) == fingerprint.tree_fingerprint(f)
    assert fingerprint.weights_fingerprint(cfg, q) == fingerprint.weights_fingerprint(cfg, f)
