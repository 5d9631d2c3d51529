"""Every registered target family fulfils the typed contract (:class:`dflash_jax.families.contract.FamilyModel`):
its functions' parameters, and their behaviour on a tiny config parsed from an HF ``config.json``
(shapes and axes agree, ``forward`` is ``lm_head`` of ``forward_hidden``, a chunked prefill equals
one pass, ``move_rows`` keeps the cache's structure); the drafters embed and project through it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.families import contract as family, registry
from dflash_jax.runtime.carry import init_paged_kv_cache
from dflash_jax.errors import DFlashError
from dflash_jax.drafter import model as drafter
from dflash_jax.testing import tiny_drafter, tiny_target
from laguna_tiny import PER_HEAD

_DENSE = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
_QWEN3_MOE = dict(_DENSE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)

_GPT_OSS = dict(_DENSE, architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=3, num_local_experts=4,
                num_experts_per_tok=2, intermediate_size=16, sliding_window=3,
                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 16, "rope_theta": 150000.0})

_QWEN3_5 = dict(_DENSE, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", num_hidden_layers=4, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})

_GEMMA4 = dict(_DENSE, architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", num_hidden_layers=3, sliding_window=3,
               layer_types=["sliding_attention", "full_attention", "full_attention"], per_layer_config={"1": {"head_dim": 16},
               "2": {"head_dim": 16}}, hidden_size_per_layer_input=4, vocab_size_per_layer_input=64, final_logit_softcapping=5.0,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})

# one tiny HF config.json per family: a family registered without one fails test_every_family_has_a_tiny_config
TINY_HF = {"dense": _DENSE, "laguna": PER_HEAD, "qwen3_moe": _QWEN3_MOE, "gpt_oss": _GPT_OSS, "qwen3_5": _QWEN3_5, "gemma4": _GEMMA4}


def test_every_family_has_a_tiny_config():
    assert {fam.name for fam in registry.TARGET_FAMILIES} <= set(TINY_HF)


@pytest.mark.parametrize("fam", registry.TARGET_FAMILIES, ids=lambda f: f.name)
def test_signatures(fam):
    assert isinstance(fam.model, family.FamilyModel)
    for name in family.CAPABILITIES:
        assert isinstance(getattr(fam.model, name), bool)
    for name in family.SIGNATURES:
        if getattr(fam.model, name) is None:
            assert name in family.OPTIONAL
            continue
        family.check_signature(name, getattr(fam.model, name), fam.name)


def test_a_wrong_signature_is_refused():
    def embed(params, tokens):  # the old, cfg-less embed
        return params

    with pytest.raises(DFlashError, match=r"family\.embed.*leading parameters \('params', 'cfg', 'tokens'\)"):
        family.check_signature("embed", embed)


@pytest.mark.parametrize("fam", registry.TARGET_FAMILIES, ids=lambda f: f.name)
def test_behaviour_on_a_tiny_config(fam):
    cfg = fam.parse_hf(TINY_HF[fam.name], f"{fam.name}/config.json")
    assert isinstance(cfg, fam.config_type) and registry.family_of(cfg) is fam and registry.module_for(cfg) is fam.model
    m = fam.model
    params = m.init_params(cfg, jax.random.key(0), 0.3)
    shapes = jax.tree_util.tree_map(lambda a: tuple(a.shape), params)
    assert shapes == jax.tree_util.tree_map(tuple, m.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    axes = m.param_axes(cfg)
    assert jax.tree_util.tree_structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree_util.tree_structure(params)
    assert all(len(a) == len(s) for a, s in zip(jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
                                                  jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))))
    b, t, s = 2, 6, 12
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    assert m.embed(params, cfg, tokens).shape == (b, t, cfg.hidden_size)
    hidden, cache, _ = jax.jit(m.forward_hidden, static_argnums=1)(params, cfg, tokens, pos, m.init_cache(cfg, b, s))
    forward = jax.jit(m.forward, static_argnums=1)
    logits, _, _ = forward(params, cfg, tokens, pos, m.init_cache(cfg, b, s))
    assert hidden.shape == (b, t, cfg.hidden_size) and logits.shape == (b, t, cfg.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, m.lm_head(params, cfg, hidden), rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([0, 3, cfg.vocab_size - 1], jnp.int32)  # lm_head on a column subset (a draft vocabulary's head)
    np.testing.assert_allclose(m.lm_head({"lm_head": draft_vocab.head_columns(params, ids)}, cfg, hidden), logits[..., ids],
                               rtol=1e-5, atol=1e-5)
    c = m.init_cache(cfg, b, s)
    first, c, _ = forward(params, cfg, tokens[:, :4], pos[:, :4], c)
    rest, c, _ = forward(params, cfg, tokens[:, 4:], pos[:, 4:], c)
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), logits, rtol=1e-4, atol=1e-4)
    if m.recurrent_state:  # a recurrent (hybrid) family: no trees; its verify keeps per-position states
        assert not m.trees
        with pytest.raises(DFlashError, match="tree"):
            m.move_rows(cfg, c, pos[:, 4:], pos[:, 4:] + 2)
        kept = m.commit_block_states(cfg, jax.jit(m.forward_hidden, static_argnums=1)(params, cfg, tokens[:, 4:], pos[:, 4:],
                                                                                      m.keep_block_states(cfg, c))[1], jnp.asarray([1, 2]))
        assert jax.tree_util.tree_structure(kept) == jax.tree_util.tree_structure(c)
        return
    moved = m.move_rows(cfg, c, pos[:, 4:], pos[:, 4:] + 2)
    assert jax.tree_util.tree_structure(moved) == jax.tree_util.tree_structure(c)
    if m.paged_kv:
        _check_paged(m, cfg, params, tokens, pos, logits, moved)


def _check_paged(m, cfg, params, tokens, pos, logits, moved):
    """The same two passes on a :class:`PagedKVCache` whose rows own scrambled pages of 4 slots
    give the same logits, and a tree's slot move reads back as the unpaged cache's."""
    b, s = tokens.shape[0], moved.capacity
    k = moved.k
    pc = init_paged_kv_cache(k.shape[0], b, s, b * s // 4 + 1, k.shape[3], k.shape[4], k.dtype, page_size=4)
    pc = pc.replace(table=jnp.asarray(1 + np.random.default_rng(1).permutation(b * s // 4).reshape(b, s // 4), jnp.int32))
    forward = jax.jit(m.forward, static_argnums=1)
    first, pc, _ = forward(params, cfg, tokens[:, :4], pos[:, :4], pc)
    rest, pc, _ = forward(params, cfg, tokens[:, 4:], pos[:, 4:], pc)
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), logits, rtol=1e-4, atol=1e-4)
    pm = m.move_rows(cfg, pc, pos[:, 4:], pos[:, 4:] + 2)
    every = pm.slots(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))
    np.testing.assert_allclose(pm.k[:, every], moved.k, rtol=1e-4, atol=1e-4)


def test_the_drafter_embeds_and_projects_through_the_family():
    """A family that scales its embedding and caps its logits reaches the drafter: the drafter's
    hidden equals the unscaled family's with ``input_embedding_scale`` doing the same scaling, and
    its logits carry the family's cap."""
    cfg, params = tiny_target("qwen3", seed=1)
    dcfg, dparams = tiny_drafter(cfg, seed=2, layer_ids=(0, 2), block_size=4)
    ctx = jnp.asarray(np.random.default_rng(1).normal(size=(1, 5, 2 * cfg.hidden_size)), jnp.float32)
    k, v = drafter.context_kv(dparams, dcfg, ctx, jnp.arange(5, dtype=jnp.int32)[None])
    block, bpos = jnp.asarray([[3, dcfg.mask_token_id, dcfg.mask_token_id, dcfg.mask_token_id]]), 5 + jnp.arange(4, dtype=jnp.int32)[None]

    def run(dc, family):
        @jax.jit
        def go(dparams, params):
            h = drafter.forward(dparams, dc, family, params, cfg, block, bpos, k, v, jnp.asarray([5]))
            return h, drafter.logits(dparams, dc, family, params, cfg, h)

        return go(dparams, params)

    model = registry.module_for(cfg)
    h_scaled_by_drafter, _ = run(dataclasses.replace(dcfg, input_embedding_scale=3.0), model)
    scaled = dataclasses.replace(model, embed=lambda params, cfg, tokens: 3.0 * model.embed(params, cfg, tokens),
                                 lm_head=lambda params, cfg, hidden: jnp.tanh(model.lm_head(params, cfg, hidden) / 0.5) * 0.5)
    h, logits = run(dcfg, scaled)
    np.testing.assert_allclose(h, h_scaled_by_drafter, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(logits))) <= 0.5
