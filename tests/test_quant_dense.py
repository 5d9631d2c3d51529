"""A dense GGUF target kept quantized (``weights="quantized"``): tiny files mixing every block type
across layers load without a float copy of any quantized weight and decode as the same file
dequantized by gguf-py (the float path) does; the ``weights`` option resolves as docs/models.md says."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import weights_choice
from dflash_jax.drafter import vocab as dv
from dflash_jax.errors import DFlashError
from dflash_jax.families.dense import gguf as G
from dflash_jax.families.dense import model as dense
from dflash_jax.nn import quant
from dflash_jax.nn.params import is_per_layer
from tiny_gguf import Q, kquant_bytes, model_tensors, tiny_cfg, write_model

LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
K_QUANTS = ("Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K")


def mixed_file(path, family: str, tie: bool, types_of, seed: int = 0) -> str:
    """A tiny dense GGUF (hidden 256, so K-quants fit) whose matrix ``j`` (in file order) has type
    ``types_of(name, j)``; K-quants are valid random blocks, the others quantized from random floats."""
    cfg = dataclasses.replace(tiny_cfg(family, tie), hidden_size=256, intermediate_size=256, head_dim=64)
    params = jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(seed), scale=0.05))
    rng = np.random.default_rng(seed)
    tensors, j = [], 0
    for name, arr, qtype in model_tensors(cfg, params, Q.Q8_0):
        kind = None if qtype is None else types_of(name, j)
        j += qtype is not None
        if kind in K_QUANTS:
            tensors.append((name, kquant_bytes(kind, arr.shape, rng, d=2e-4), Q[kind]))
        else:
            tensors.append((name, arr, None if kind is None else Q[kind]))
    return write_model(path, cfg, params, tensors=tensors)


def cycling(name, i):
    return (LEGACY + K_QUANTS)[i % 11]


@pytest.fixture(scope="module", params=[("llama", False), ("qwen3", True)], ids=["llama-untied", "qwen3-tied"])
def mixed(request, tmp_path_factory):
    family, tie = request.param
    path = mixed_file(tmp_path_factory.mktemp("q") / "m.gguf", family, tie, cycling)
    return path, dj.load_target(path, weights="quantized"), dj.load_target(path, weights="float")


def test_every_quantized_tensor_stays_quantized_with_no_float_copy(mixed):
    path, tq, tf = mixed
    assert tq.weights == "quantized" and tf.weights == "float"
    leaves = jax.tree_util.tree_leaves(tq.params, is_leaf=quant.is_quantized)
    formats = {w.format for w in leaves if quant.is_quantized(w)}
    assert formats == {k.lower() for k in LEGACY + K_QUANTS}
    assert all(w.ndim == 1 for w in leaves if not quant.is_quantized(w))  # norms only: no float matrix, no [out, in] copy
    assert "lm_head_t" not in tq.params and is_per_layer(tq.params["layers"])  # mixed types: per layer


def test_quantized_logits_and_greedy_ids_equal_the_float_path(mixed):
    """The float path dequantizes with gguf-py (``gguf.quants.dequantize``): the oracle."""
    path, tq, tf = mixed
    cfg = tq.cfg
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    fwd = jax.jit(dense.MODEL.forward, static_argnums=1)
    want = np.asarray(fwd(tf.params, cfg, tokens, pos, dense.MODEL.init_cache(cfg, 2, 9))[0])
    got = np.asarray(fwd(tq.params, cfg, tokens, pos, dense.MODEL.init_cache(cfg, 2, 9))[0])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    prompt = [[3, 1, 4, 1, 5, 9]]
    ids_f = dj.generate(tf, prompt, max_new_tokens=8).output_ids
    assert dj.generate(tq, prompt, max_new_tokens=8).output_ids == ids_f


def test_no_float_cache_is_written(tmp_path):
    path = mixed_file(tmp_path / "m.gguf", "llama", False, cycling)
    dj.load_target(path, weights="quantized")
    assert not G.cache_path(path).exists()


def test_uniform_layers_stack_when_asked_and_mixed_ones_stay_per_layer(tmp_path):
    uniform = mixed_file(tmp_path / "u.gguf", "qwen3", True, lambda name, i: "Q4_K" if name.startswith("blk.") else "Q8_0")
    t = dj.load_target(uniform, weights="quantized", layers="stacked")
    assert isinstance(t.params["layers"], dict) and t.params["layers"]["wq"].lead == (2,)
    mixed = mixed_file(tmp_path / "m.gguf", "qwen3", True, cycling)
    assert is_per_layer(dj.load_target(mixed, weights="quantized", layers="stacked").params["layers"])


def test_draft_vocabulary_columns_of_a_quantized_head(mixed):
    path, tq, tf = mixed
    ids = jnp.array([0, 5, 17, 40, 63])
    cols = dv.head_columns(tq.params, ids)
    assert isinstance(cols, quant.QuantizedWeight)  # the columns stay quantized (only the chosen rows)
    np.testing.assert_allclose(np.asarray(cols.dequantized()), np.asarray(dv.head_columns(tf.params, ids)),
                               rtol=1e-6, atol=1e-7)


def test_weights_option_resolves(tmp_path, monkeypatch):
    """auto: quantized unless the backend is in FLOAT_FASTER and the float weights fit; quantized
    of a float file is float; an unknown value and int8 of a GGUF are refused, naming the option."""
    qfile = mixed_file(tmp_path / "q.gguf", "qwen3", True, lambda name, i: "Q8_0")
    cfg = tiny_cfg("qwen2")
    ffile = write_model(tmp_path / "f.gguf", cfg, jax.tree_util.tree_map(np.asarray, dense.MODEL.init_params(cfg, jax.random.PRNGKey(0))))
    monkeypatch.setattr(weights_choice, "FLOAT_FASTER", {})
    assert dj.load_target(qfile).weights == "quantized"
    monkeypatch.setattr(weights_choice, "FLOAT_FASTER", {jax.default_backend(): "a measurement"})
    assert dj.load_target(qfile).weights == "float"
    monkeypatch.setattr(weights_choice, "free_memory", lambda backend: 1000)  # float weights do not fit
    assert dj.load_target(qfile).weights == "quantized"
    assert dj.load_target(ffile, weights="quantized").weights == "float"
    with pytest.raises(DFlashError, match=r"weights \(--weights\): unsupported value 'fp4'"):
        dj.load_target(qfile, weights="fp4")
    with pytest.raises(DFlashError, match=r"weights \(--weights\): 'int8' for the GGUF file"):
        dj.load_target(qfile, weights="int8")


def test_a_drafter_follows_its_target_unless_told():
    def float_only(path, target_cfg, dtype="float32"):
        return None, None

    def any_weights(path, target_cfg, dtype="float32", weights="float"):
        return None, None

    load, choice = weights_choice.loader(float_only, "quantized", False, "d", "float32")
    assert load is float_only and choice == "float"  # following the target: a float-only loader loads float
    with pytest.raises(DFlashError, match=r"weights \(--weights\): 'int8' is not supported for the drafter d"):
        weights_choice.loader(float_only, "int8", True, "d", "float32")
    load, choice = weights_choice.loader(any_weights, "int8", True, "d", "float32")
    assert choice == "int8" and load.keywords == {"weights": "int8"}
