"""Every jitted step a user calls lowers for CUDA and TPU, checked on this CPU-only machine.

``jax.export.export(jitted, platforms=("cuda", "tpu"))`` lowers with each platform's lowering
rules alone (no GPU, no plugin): a construct that has only a CPU lowering, or that lowers to a
host callback or another custom call without a stable target, fails here instead of on the first
lent GPU. Covered: plain and speculative prefill chunks and their finish, the decode step, propose,
verify, the on-device ``generate`` loop and ``replace_rows``, greedy and sampled (argmax and
sampled proposals), the dense target and Laguna (MoE dispatch, sliding rings) with the generic,
reduced-vocabulary and Laguna drafters, the drafter training step, and the sharded loop on an
abstract 4-device mesh (``jax.sharding.AbstractMesh``: shardings of 4 devices, no devices needed).
Lowering only, of abstract weights: nothing is drawn or compiled.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import AbstractMesh

from dflash_jax.decode import loop as decode
from dflash_jax.decode import step as speculative
from dflash_jax.runtime import sharding as shd
from dflash_jax.decode.state import Decoding, Params
from dflash_jax.drafter import model as drafter_mod
from dflash_jax.families.registry import module_for
from dflash_jax.drafter.model import drafter_config_from_hf
from dflash_jax.decode.sampling import SamplingConfig
from dflash_jax.testing import tiny_drafter, tiny_target
from laguna_tiny import LAGUNA_DRAFTER, PER_HEAD, tiny_laguna

PLATFORMS = ("cuda", "tpu")
PROMPTS = [[5, 9, 17, 3], [40, 2]]
SAMPLINGS = {"greedy": (SamplingConfig(), "argmax"), "sampled": (SamplingConfig(temperature=0.7, top_k=5, top_p=0.9), "argmax"),
             "sampled-proposals": (SamplingConfig(temperature=0.7, top_p=0.9), "sample")}


def shapes_only(make):
    """``(cfg, params)`` of ``make()`` with the params as :class:`jax.ShapeDtypeStruct` (lowering
    needs shapes and dtypes only: no weights are drawn)."""
    made = []
    params = jax.eval_shape(lambda: made.append(make()) or made[0][1])
    return made[0][0], params


@pytest.fixture(scope="session")
def models():
    """``{name: (target cfg, target params, drafter cfg, drafter params)}`` of tiny models (abstract params)."""
    cfg, p = shapes_only(lambda: tiny_target("qwen3"))
    lcfg, lp = shapes_only(lambda: tiny_laguna(PER_HEAD))
    ldcfg = drafter_config_from_hf(LAGUNA_DRAFTER)
    return {"dense": (cfg, p) + shapes_only(lambda: tiny_drafter(cfg)),
            "dense-draft-vocab": (cfg, p) + shapes_only(lambda: tiny_drafter(cfg, draft_vocab_size=32)),
            "laguna": (lcfg, lp) + shapes_only(lambda: (ldcfg, drafter_mod.init_params(ldcfg, jax.random.key(1))))}


def lower(jitted, *args):
    """The :class:`jax.export.Exported` of ``jitted(*args)`` for CUDA and TPU, and its StableHLO text."""
    exp = export.export(jitted, platforms=PLATFORMS)(*args)
    assert exp.platforms == PLATFORMS
    return exp, exp.mlir_module()


def _donates(text: str) -> bool:
    """Whether the lowered main function takes donated buffers (aliased to an output or not)."""
    return "tf.aliasing_output" in text or "jax.buffer_donor = true" in text


def decoding(models, name, spec, sampling):
    """``(params, state, static)`` of a plain or speculative (``spec``) decoding of ``PROMPTS``."""
    cfg, p, dcfg, dp = models[name]
    samp, mode = SAMPLINGS[sampling]
    static = Decoding(cfg, dcfg if spec else None, mode if spec else "argmax")
    params = Params(p, dp if spec else None)
    return params, decode.init_state(static, PROMPTS, 24, 8, sampling=samp), static


CASES = [(name, spec, samp) for name in ("dense", "laguna") for spec in (False, True) for samp in ("greedy", "sampled")]
CASES += [("dense", True, "sampled-proposals"), ("laguna", True, "sampled-proposals"), ("dense-draft-vocab", True, "greedy"),
          ("dense-draft-vocab", True, "sampled-proposals")]


@pytest.mark.parametrize("name,spec,sampling", CASES, ids=[f"{n}-{'spec' if s else 'plain'}-{m}" for n, s, m in CASES])
def test_decoding_steps_lower_for_cuda_and_tpu(models, name, spec, sampling):
    params, state, static = decoding(models, name, spec, sampling)
    acc = jnp.zeros((len(PROMPTS), static.target.vocab_size), jnp.float32)
    steps = {
        "prefill_chunk": (decode.prefill_chunk, params, state, static, acc, jnp.int32(0), 4),
        "finish_prefill": (decode.finish_prefill, state, static, acc),
        "decode_step": (decode.decode_step, params, state, static),
        "generate_until": (decode.generate_until, params, state, static, jnp.int32(len(PROMPTS))),
        "replace_rows": (decode.replace_rows, state, decode.init_state(static, PROMPTS[:1], 24, 8), jnp.asarray([1], jnp.int32)),
    }
    if spec:
        drafts = jnp.zeros((len(PROMPTS), static.n_max), jnp.int32)
        steps["propose_block"] = (speculative.propose_block, params, state, static)
        steps["verify_block"] = (speculative.verify_block, params, state, static, drafts)
    for step, (jitted, *args) in steps.items():
        _, text = lower(jitted, *args)
        donates = step != "propose_block"  # every step but propose donates the state
        assert _donates(text) == donates, step


@pytest.mark.parametrize("sampling", ["greedy", "sampled-proposals"])
def test_adaptive_depth_steps_lower_for_cuda_and_tpu(models, sampling):
    """``n_max="auto"``: the step (a width chosen on device, once-or-never loops per width), the
    loop and the verify of given drafts lower and donate the state."""
    from dflash_jax.decode.auto.costs import CostModel, depth_policy
    from dflash_jax.decode.auto.adaptive import verify_auto
    from dflash_jax.decode.auto.policy import Calibration

    cfg, p, dcfg, dp = models["dense"]
    samp, mode = SAMPLINGS[sampling]
    static = Decoding(cfg, dcfg, mode, n_max="auto")
    n = static.depth
    params = Params(p, dp, depth_policy(Calibration.identity(n), CostModel.forcing(n, n)))
    state = decode.init_state(static, PROMPTS, 24, 8, sampling=samp)
    drafts, conf = jnp.zeros((len(PROMPTS), n), jnp.int32), jnp.zeros((len(PROMPTS), n), jnp.float32)
    verify_args = (drafts, conf, False)
    for jitted, *args in ((decode.decode_step, params, state, static), (decode.generate_until, params, state, static, jnp.int32(2)),
                          (verify_auto, params, state, static, *verify_args)):
        _, text = lower(jitted, *args)
        assert _donates(text), jitted


def test_drafter_training_step_lowers_for_cuda_and_tpu(models):
    from dflash_jax.train.optim import TrainConfig
    from dflash_jax.train.step import init_train_state, train_step

    cfg, p, dcfg, _ = models["dense"]
    tc = TrainConfig(steps=4, batch_size=2, max_len=16, num_anchors=3, compute_dtype="bfloat16")
    batch = {"tokens": jnp.ones((2, 16), jnp.int32), "loss_mask": jnp.ones((2, 16), jnp.float32)}
    for extra in ({}, {"features": jnp.zeros((2, 16, len(dcfg.target_layer_ids) * cfg.hidden_size), jnp.bfloat16)}):
        _, text = lower(train_step, jax.eval_shape(lambda: init_train_state(dcfg, tc)), p, dict(batch, **extra), dcfg, cfg, tc)
        assert _donates(text)


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@pytest.mark.parametrize("name,mesh_shape,split", [("dense", (2, 2, 1), ('{"data"}', '{"model"}')),
                                                   ("laguna", (1, 2, 2), ('{"model"}', '{"expert"}'))])
def test_sharded_steps_lower_for_cuda_and_tpu_on_four_devices(models, name, mesh_shape, split):
    mesh = AbstractMesh(mesh_shape, shd.MESH_AXES)
    for spec in (False, True):
        params, state, static = decoding(models, name, spec, "greedy")
        cfg, dcfg = static.target, static.drafter
        p = _abstract(params.target, shd.param_shardings(params.target, module_for(cfg).param_axes(cfg), mesh))
        dp = _abstract(params.drafter, shd.param_shardings(params.drafter, drafter_mod.param_axes(dcfg), mesh)) if spec else None
        st = _abstract(state, shd.state_shardings(state, mesh))
        acc = jnp.zeros((len(PROMPTS), cfg.vocab_size), jnp.float32)
        for jitted, *args in ((decode.prefill_chunk, Params(p, dp), st, static, acc, jnp.int32(0), 4),
                              (decode.generate_until, Params(p, dp), st, static, jnp.int32(len(PROMPTS)))):
            exp, text = lower(jitted, *args)
            assert exp.nr_devices == 4
            assert all(s in text for s in split), (name, spec, split)


def test_a_host_callback_is_refused_by_the_check():
    """The check can fail: a step with a host callback (a host sync, never allowed in a step) does
    not export for the GPU or TPU."""

    def step(x):
        return jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    for platforms in (PLATFORMS, ("cuda",), ("tpu",)):
        with pytest.raises((ValueError, NotImplementedError)):
            export.export(jax.jit(step), platforms=platforms)(jnp.ones(3))
