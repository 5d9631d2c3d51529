"""The models as Flax NNX modules (:mod:`dflash_jax.nn.module`): for every target family and drafter
kind, in each layout, ``.model`` is an ``nnx.Module`` of the family's or kind's own class whose
``nnx.Param`` state is every leaf of the parameter tree (the same buffers, the logical axes as
metadata); its methods compute what the model functions compute; the decode steps take its
``nnx.State`` and run what the module holds; a loaded checkpoint's every tensor is a param."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import dflash_jax as dj
from dflash_jax.drafter import model as drafter_model
from dflash_jax.drafter.model import drafter_config_from_hf
from dflash_jax.drafter.module import DrafterModule
from dflash_jax.families import registry
from dflash_jax.families.module import TargetModule
from dflash_jax.loading import Drafter, Target
from dflash_jax.nn.module import axes_of, tree_of
from dflash_jax.nn.params import unstack_layers
from dflash_jax.testing import reference_greedy, tiny_drafter, tiny_target
from laguna_tiny import LAGUNA_DRAFTER
from test_families import TINY_HF

IS_AXES = dict(is_leaf=lambda x: isinstance(x, tuple))


def _check_state(module, params, axes) -> None:
    """``module``'s params are ``params``' leaves themselves, with ``axes`` as their metadata, and
    its state reads back as ``params``' tree."""
    values = jax.tree_util.tree_leaves(nnx.state(module, nnx.Param))
    leaves = jax.tree_util.tree_leaves(params)
    assert len(values) == len(leaves) and all(a is b for a, b in zip(values, leaves))
    assert axes_of(module) == axes
    for state in (nnx.state(module), nnx.split(module)[1]):
        back = tree_of(state)
        assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
        assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(back), leaves))


def _layouts(fam):
    return ("stacked", "per_layer") if fam.model.per_layer else ("stacked",)


@pytest.mark.parametrize("fam,layout", [(f, lay) for f in registry.TARGET_FAMILIES for lay in _layouts(f)],
                         ids=lambda x: getattr(x, "name", x))
def test_every_family_is_an_nnx_module(fam, layout):
    m = fam.model
    cfg = fam.parse_hf(TINY_HF[fam.name], f"{fam.name}/config.json")
    params = m.init_params(cfg, jax.random.key(0), 0.3)
    if layout == "per_layer":
        params = unstack_layers(params)
    target = Target(cfg=cfg, params=params)
    module = target.model
    assert isinstance(module, nnx.Module) and isinstance(module, TargetModule) and type(module).family is m
    assert type(module).__name__.endswith("Target") and module.cfg is cfg
    _check_state(module, params, m.param_axes(cfg, per_layer=layout == "per_layer"))
    b, t = 2, 5
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    graph, state = nnx.split(module)

    @jax.jit
    def both(state, params):  # what a decode step does (the state in, read at trace time) beside the model function
        merged = nnx.merge(graph, state)
        return merged(tokens, pos, merged.init_cache(b, 8))[0], m.forward(params, cfg, tokens, pos, m.init_cache(cfg, b, 8))[0]

    got, want = both(state, params)
    # one program computing both: XLA may fuse the two copies of the math differently (it does under
    # the tests' loop emitters for the stacked MoE and hybrid families), so equal up to float rounding
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_target_module_methods_are_the_family_functions():
    cfg, params = tiny_target("qwen3", seed=4)
    module, m = Target(cfg=cfg, params=params).model, registry.module_for(cfg)
    tokens, pos = jnp.asarray([[3, 1, 4, 1]], jnp.int32), jnp.arange(4, dtype=jnp.int32)[None]
    hidden = module.hidden_states(tokens, pos, module.init_cache(1, 8))[0]
    np.testing.assert_array_equal(hidden, m.forward_hidden(params, cfg, tokens, pos, m.init_cache(cfg, 1, 8))[0])
    np.testing.assert_array_equal(module.logits(hidden), m.lm_head(params, cfg, hidden))
    np.testing.assert_array_equal(module.embed_tokens(tokens), m.embed(params, cfg, tokens))


def _drafters():
    """``(target cfg, target params, drafter cfg, drafter params)`` of each drafter kind."""
    cfg, params = tiny_target("llama", seed=1, vocab_size=96, hidden_size=32, num_hidden_layers=4, head_dim=8, intermediate_size=48)
    generic = tiny_drafter(cfg, seed=2, block_size=4, layer_ids=(0, 2), hidden_size=32, head_dim=8, intermediate_size=40)
    dflash2 = tiny_drafter(cfg, seed=3, block_size=4, layer_ids=(0, 2), hidden_size=32, head_dim=8, intermediate_size=40,
                           architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)
    lcfg = drafter_config_from_hf(LAGUNA_DRAFTER)
    laguna = (lcfg, drafter_model.init_params(lcfg, jax.random.key(4)))
    return {"DFlashDraftModel": (cfg, params, *generic), "DFlash2DraftModel": (cfg, params, *dflash2),
            "DFlashLagunaForCausalLM": (cfg, params, *laguna)}


@pytest.mark.parametrize("arch,layout", [(a, lay) for a in ("DFlashDraftModel", "DFlash2DraftModel", "DFlashLagunaForCausalLM")
                                         for lay in ("stacked", "per_layer") if lay == "stacked" or drafter_model.drafter_kind(a).per_layer])
def test_every_drafter_kind_is_an_nnx_module(arch, layout):
    cfg_t, params_t, cfg, params = _drafters()[arch]
    if layout == "per_layer":
        params = unstack_layers(params)
    target, drafter = Target(cfg=cfg_t, params=params_t), Drafter(cfg=cfg, params=params)
    module = drafter.model
    assert isinstance(module, DrafterModule) and type(module).architecture == arch == cfg.architecture
    _check_state(module, params, drafter_model.param_axes(cfg, per_layer=layout == "per_layer"))
    features = jnp.asarray(np.random.default_rng(1).normal(size=(1, 5, len(cfg.target_layer_ids) * cfg_t.hidden_size)), jnp.float32)
    positions = jnp.arange(5, dtype=jnp.int32)[None]
    k, v = module.context(features, positions)
    want_k, want_v = drafter_model.context_kv(params, cfg, features, positions)
    np.testing.assert_array_equal(k, want_k), np.testing.assert_array_equal(v, want_v)
    block = jnp.asarray([[3] + [cfg.mask_token_id] * (cfg.block_size - 1)], jnp.int32)
    bpos = 5 + jnp.arange(cfg.block_size, dtype=jnp.int32)[None]
    ctx = (jnp.pad(k, ((0, 0), (0, 0), (0, 4), (0, 0), (0, 0))), jnp.pad(v, ((0, 0), (0, 0), (0, 4), (0, 0), (0, 0))), jnp.asarray([5]))
    hidden = module(target.model, block, bpos, *ctx)
    family = registry.module_for(cfg_t)
    np.testing.assert_array_equal(hidden, drafter_model.forward(params, cfg, family, params_t, cfg_t, block, bpos, *ctx))
    np.testing.assert_array_equal(module.logits(target.model, hidden), drafter_model.logits(params, cfg, family, params_t, cfg_t, hidden))


def test_the_steps_take_the_state_and_run_what_the_module_holds():
    """``dj.generate`` passes ``Params(target.state(), drafter.state())``: the parameter trees
    until ``.model`` is read, the modules' ``nnx.State`` after; both give the target's greedy
    decode; a param set in place on the module (the final norm zeroed: every logit 0, so greedy
    picks id 0) is what the next generation runs."""
    cfg, params = tiny_target("llama", seed=5)
    dcfg, dparams = tiny_drafter(cfg, seed=6)
    target, drafter = Target(cfg=cfg, params=params), Drafter(cfg=dcfg, params=dparams)
    prompt, run = [5, 9, 17, 3], lambda: dj.generate(target, [prompt], max_new_tokens=10, drafter=drafter, n_max=3).output_ids[0]
    assert target.state() is params and drafter.state() is dparams
    out = run()
    assert out == reference_greedy(params, cfg, prompt, 10) and out != [0] * 10
    assert isinstance(target.model, nnx.Module) and isinstance(drafter.model, nnx.Module)
    assert isinstance(target.state(), nnx.State) and isinstance(drafter.state(), nnx.State)
    assert run() == out
    target.model.norm.set_value(jnp.zeros_like(params["norm"]))
    assert run() == [0] * 10


def test_the_package_and_a_target_import_no_flax():
    """``import dflash_jax``, a ``Target`` and its ``state()`` (what the command line and the server
    run) import no flax (about 0.5 s of every warm command, BENCHMARKS.md); reading ``.model`` does."""
    import subprocess
    import sys

    script = ("import sys, dflash_jax\nfrom dflash_jax.loading import Target\nfrom dflash_jax.testing import tiny_target\n"
              "cfg, params = tiny_target('llama', seed=5)\nt = Target(cfg=cfg, params=params)\n"
              "assert t.state() is params and 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)\n"
              "t.model\nassert 'flax.nnx' in sys.modules\nprint('OK')")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_a_loaded_checkpoint_is_its_module(serve_tiny_model):
    """``dj.load_target`` of a transformers checkpoint: ``.model``'s params are ``.params``' leaves
    (with the output head's copies) and every tensor of the checkpoint is one of them."""
    folder, target, _ = serve_tiny_model
    module = target.model
    values = jax.tree_util.tree_leaves(nnx.state(module, nnx.Param))
    assert len(values) == len(jax.tree_util.tree_leaves(target.params))
    held = [np.asarray(v) for v in values]
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors
    for name, t in tensors.items():
        assert any(h.shape == t.shape and np.array_equal(h, t) or h.shape == t.T.shape and np.array_equal(h, t.T) for h in held), name
    assert all(len(a) == np.ndim(v) for a, v in zip(jax.tree_util.tree_leaves(axes_of(module), **IS_AXES), values))


def test_set_weights_converts_layouts_and_dtypes_and_names_a_mismatch():
    """``set_weights`` sets a module's params from a tree or state in the other layer layout (stacked
    into a per-layer module and the reverse), cast to each param's dtype; a weight of another
    shape, or a missing one, is a DFlashError naming it, and the module is left as it was."""
    from dflash_jax.errors import DFlashError
    from dflash_jax.nn.module import set_weights
    from dflash_jax.nn.params import stack_layers

    cfg, _ = tiny_target("llama", seed=5)
    dcfg, want = tiny_drafter(cfg, seed=6)
    _, other = tiny_drafter(cfg, seed=7)
    per_layer = Drafter(cfg=dcfg, params=unstack_layers(other)).model
    set_weights(per_layer, want)
    for x, y in zip(jax.tree_util.tree_leaves(tree_of(per_layer)), jax.tree_util.tree_leaves(unstack_layers(want))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stacked = Drafter(cfg=dcfg, params=jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), other)).model
    set_weights(stacked, nnx.state(per_layer))
    got = tree_of(stacked)
    assert got["fc"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["fc"]), np.asarray(want["fc"].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(got["layers"]["wq"]), np.asarray(stack_layers(want)["layers"]["wq"].astype(jnp.bfloat16)))
    before = np.asarray(tree_of(per_layer)["fc"])
    with pytest.raises(DFlashError, match=r"weights\['fc'\]: shape \(1, \d+\)"):
        set_weights(per_layer, dict(want, fc=want["fc"][:1]))
    with pytest.raises(DFlashError, match=r"weights\['fc'\]: missing"):
        set_weights(per_layer, {k: v for k, v in want.items() if k != "fc"})
    np.testing.assert_array_equal(np.asarray(tree_of(per_layer)["fc"]), before)
