"""Logical-axis sharding: PartitionSpec rules, and sharded speculative decoding on a 4-device CPU mesh.

conftest.py pins the test process to one CPU device, so the multi-device run happens in a
subprocess with ``--xla_force_host_platform_device_count=4``. Its oracle is the same generation
with unsharded params and state: greedy tokens must match exactly.
"""

import textwrap

import jax
import pytest
from conftest import run_on_cpu_devices
from jax.sharding import AbstractMesh, PartitionSpec as P

from dflash_jax.decode import loop as decode
from dflash_jax.runtime import sharding as shd
from dflash_jax.runtime.carry import KV_AXES
from dflash_jax.decode.state import Decoding
from dflash_jax.errors import DFlashError
from dflash_jax.families.dense import model as dense
from dflash_jax.nn.params import unstack_layers
from dflash_jax.drafter import model as drafter
from dflash_jax.testing import tiny_drafter, tiny_drafter_config, tiny_target, tiny_target_config

MESH = AbstractMesh((2, 2, 1), shd.MESH_AXES)  # data=2, model=2, expert=1 (shape only)


def test_default_rules_and_replicated_axes():
    r = shd.DEFAULT_RULES
    assert r["batch"] == "data" and r["q_heads"] == r["kv_heads"] == r["mlp"] == r["vocab"] == "model"
    assert r["experts"] == "expert"
    for name in ("layers", "embed", "seq", "head_dim", "features", "captures", None):
        assert r.mesh_axes(name) == ()
    assert shd.logical_to_spec(("layers", "embed", "q_heads"), r, MESH, (3, 64, 64)) == P(None, None, "model")
    assert shd.logical_to_spec(KV_AXES, r, MESH, (3, 2, 16, 2, 16)) == P(None, "data", None, "model", None)
    assert shd.logical_to_spec(("layers", "embed"), r, MESH, (3, 64)) == P(None, None)
    # no mesh: the rules alone
    assert shd.logical_to_spec(("experts", "embed", "expert_mlp"), r) == P("expert", None, "model")


def test_rules_are_frozen_and_hashable():
    r = shd.DEFAULT_RULES.replace(batch=None, seq="data")
    assert r["seq"] == "data" and r.get("batch") is None and shd.DEFAULT_RULES["batch"] == "data"
    assert hash(r) == hash(shd.DEFAULT_RULES.replace(batch=None, seq="data"))
    with pytest.raises(AttributeError):
        r.x = 1
    with pytest.raises(DFlashError, match="mesh axis name"):
        shd.ShardingRules(batch=3)


def test_non_dividing_axis_is_replicated_or_raises():
    r = shd.DEFAULT_RULES
    # 3 kv heads * 5 = 15 does not split 2 ways: replicated by default
    assert shd.logical_to_spec(("layers", "embed", "kv_heads"), r, MESH, (3, 64, 15)) == P(None, None, None)
    assert shd.logical_to_spec(KV_AXES, r, MESH, (3, 3, 16, 2, 16)) == P(None, None, None, "model", None)
    with pytest.raises(DFlashError, match=r"dimension 2 \('kv_heads'\).*not divisible by mesh axis 'model'"):
        shd.logical_to_spec(("layers", "embed", "kv_heads"), r, MESH, (3, 64, 15), strict=True)
    with pytest.raises(DFlashError, match="rank"):
        shd.logical_to_spec(("layers", "embed"), r, MESH, (3, 64, 15))
    # a tuple of mesh axes: the second is dropped when the product does not divide
    r2 = r.replace(batch=("data", "model"))
    assert shd.logical_to_spec(("batch",), r2, MESH, (4,)) == P(("data", "model"))
    assert shd.logical_to_spec(("batch",), r2, MESH, (6,)) == P("data")


def test_mesh_axis_used_once_per_spec():
    r = shd.DEFAULT_RULES
    assert shd.logical_to_spec(("q_heads", "kv_heads"), r, MESH, (4, 4)) == P("model", None)
    assert shd.logical_to_spec(("mlp", "vocab"), r, None) == P("model", None)
    # first claimant can't take it (uneven): the next one may
    assert shd.logical_to_spec(("q_heads", "kv_heads"), r, MESH, (3, 4)) == P(None, "model")


def test_size_one_and_missing_mesh_axes_are_dropped():
    r = shd.DEFAULT_RULES.replace(layers="pipeline")
    assert shd.logical_to_spec(("layers", "experts", "embed"), r, MESH, (2, 8, 4)) == P(None, None, None)


def test_make_mesh_errors():
    m = shd.make_mesh()
    assert dict(m.shape) == {"data": 1, "model": 1, "expert": 1}
    with pytest.raises(DFlashError, match="devices asked for"):
        shd.make_mesh(data=len(jax.devices()) + 1)
    with pytest.raises(DFlashError, match=">= 1"):
        shd.make_mesh(model=0)


def test_state_axes_cover_cache_and_context():
    cfg = tiny_target_config("qwen3")
    dcfg = tiny_drafter_config(cfg)
    st = decode.init_state(Decoding(cfg, dcfg), [[1, 2, 3], [4, 5]], 16, 4)
    ax = shd.state_axes(st)
    assert ax.tokens == ("batch", "seq") and ax.length == ("batch",) and ax.finish == ("batch",)
    assert ax.cache.k == KV_AXES and ax.speculative.ctx_k == KV_AXES and ax.speculative.ctx_v == KV_AXES
    assert ax.speculative.accepted_per_position == ("batch", None)
    assert ax.stop_ids == ("batch", None) and ax.steps == ()
    assert ax.sampling.temperature == ax.sampling.top_k == ax.sampling.top_p == ("batch",)
    # the one-device mesh: everything replicated, placement works (typed PRNG key included)
    placed = shd.shard_state(st, shd.make_mesh())
    assert placed.tokens.sharding.spec == P(None, None)


@pytest.mark.slow
def test_every_state_array_declares_axes_and_replace_rows_swaps_every_batch_leaf():
    """Axes live with the fields: every array of a state with a drafter (dense and Laguna targets)
    has declared axes of its rank, an undeclared array field raises, and replace_rows swaps
    exactly the leaves with a batch axis (so a new per-row field cannot be missed)."""
    import jax.numpy as jnp
    import numpy as np
    from dflash_jax.runtime import carry as pytree

    from dflash_jax.decode import loop as decode
    from dflash_jax.runtime.carry import declared_axes, flat_axes
    from dflash_jax.drafter.model import drafter_config_from_hf
    from laguna_tiny import LAGUNA_DRAFTER, PER_HEAD, tiny_laguna

    cfg = tiny_target_config("qwen3")
    for cfg, dc in ((cfg, tiny_drafter_config(cfg)), (tiny_laguna(PER_HEAD)[0], drafter_config_from_hf(LAGUNA_DRAFTER))):
        st = decode.init_state(Decoding(cfg, dc), [[1, 2, 3], [4, 5], [6]], 16, 4)
        leaves, axes = jax.tree_util.tree_leaves(st), flat_axes(st)
        assert len(axes) == len(leaves) and all(len(a) == np.ndim(x) for a, x in zip(axes, leaves))
        assert any("batch" in a for a in axes) and any("batch" not in a for a in axes)
        old = jax.tree_util.tree_map(lambda x: x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.zeros_like(x), st)
        one = decode.init_state(Decoding(cfg, dc), [[7]], 16, 4)
        fresh = jax.tree_util.tree_map(lambda x: x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.ones_like(x), one)
        out = decode.replace_rows(old, fresh, jnp.asarray([1], jnp.int32))
        for ax, x, leaf in zip(axes, jax.tree_util.tree_leaves(out), leaves):
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                continue
            x = np.asarray(x)
            if "batch" in ax:
                rows = np.moveaxis(x, ax.index("batch"), 0)
                assert (rows[1] == 1).all() and (rows[0] == 0).all() and (rows[2] == 0).all(), ax
            else:
                assert (x == 0).all(), ax

    @pytree.dataclass
    class Undeclared:
        per_row: jnp.ndarray

    with pytest.raises(DFlashError, match="per_row"):
        declared_axes(Undeclared(jnp.zeros((2,))))


def test_axes_tree_mismatch_raises():
    cfg = tiny_target_config("qwen3")
    shapes = dense.MODEL.param_shapes(cfg)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, cfg.dtype), shapes, is_leaf=lambda x: isinstance(x, tuple))
    good = shd.param_shardings(params, dense.MODEL.param_axes(cfg), shd.make_mesh())
    assert good["layers"]["wq"].spec == P(None, None, None)
    with pytest.raises(DFlashError, match="does not match"):
        shd.param_shardings(params, drafter.param_axes(tiny_drafter_config(cfg)), shd.make_mesh())
    per = unstack_layers(tiny_target("qwen3")[1])  # per-layer parameters (load_target on CPU)
    sp = shd.param_shardings(per, dense.MODEL.param_axes(cfg, per_layer=True), shd.make_mesh())
    assert len(sp["layers"]) == cfg.num_hidden_layers and sp["layers"][1]["wq"].spec == P(None, None)
    with pytest.raises(DFlashError, match="per_layer=True"):
        shd.param_shardings(per, dense.MODEL.param_axes(cfg), shd.make_mesh())
    dcfg, dp = tiny_drafter(cfg)  # the drafter's per-layer layout (load_drafter on CPU)
    dsp = shd.param_shardings(unstack_layers(dp), drafter.param_axes(dcfg, per_layer=True), shd.make_mesh())
    assert len(dsp["layers"]) == dcfg.num_hidden_layers and dsp["layers"][0]["wk"].spec == P(None, None)


_MULTI_DEVICE = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from dflash_jax.runtime import sharding as shd
    from dflash_jax.families.dense import model as dense
    from dflash_jax.drafter import model as drafter
    from dflash_jax.decode import loop as decode
    from dflash_jax.decode.prefill import prefill
    from dflash_jax.decode.state import Decoding, Params
    from dflash_jax.testing import tiny_drafter, tiny_target

    assert len(jax.devices()) == 4, jax.devices()
    cfg, p = tiny_target("qwen3", seed=3, num_attention_heads=4, num_key_value_heads=2)
    dcfg, dp = tiny_drafter(cfg, seed=1, num_attention_heads=4, num_key_value_heads=2)
    prompts = [[5, 9, 17, 3], [40, 2, 7]]

    static = Decoding(cfg, dcfg)

    def run(p, dp, mesh=None):
        st = decode.init_state(static, prompts, 24, 10)
        if mesh is not None:
            st = shd.shard_state(st, mesh)
        st = prefill(Params(p, dp), st, static, 4)
        return decode.decode_loop(Params(p, dp), st, static)

    ref = run(p, dp)
    mesh = shd.make_mesh(data=2, model=2)
    sp = shd.shard_params(p, dense.MODEL.param_axes(cfg), mesh)
    sdp = shd.shard_params(dp, drafter.param_axes(dcfg), mesh)
    split = [k for k, x in jax.tree_util.tree_flatten_with_path({"t": sp, "d": sdp})[0]
             if x.sharding.shard_shape(x.shape) != x.shape]
    assert split, "no parameter is split"
    wq = sp["layers"]["wq"]
    assert wq.sharding.shard_shape(wq.shape) == (wq.shape[0], wq.shape[1], wq.shape[2] // 2)
    out = run(sp, sdp, mesh)
    k = out.cache.k
    assert k.sharding.shard_shape(k.shape)[1] == 1, k.sharding   # rows still split after generate
    ck = out.speculative.ctx_k
    assert len(ck.sharding.device_set) == 4
    a, b = jax.device_get((ref.tokens, out.tokens))
    la, lb = jax.device_get((ref.length, out.length))
    assert (la == lb).all() and (a == b).all(), (a, b)
    assert (lb > np.array([4, 3])).all()
    print("OK", len(split), "split leaves")
    """
)


@pytest.mark.slow
def test_sharded_spec_generate_matches_unsharded():
    run_on_cpu_devices(_MULTI_DEVICE, 4, timeout=300)
