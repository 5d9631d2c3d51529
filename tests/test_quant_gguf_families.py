"""The non-dense GGUF targets loaded with ``weights="quantized"`` (Laguna, Qwen3-MoE, gpt-oss with
its MXFP4 experts, Gemma 4 with its fused MoE experts) keep their quantized tensors quantized and
give the logits, and the greedy tokens, of the same file loaded with ``weights="float"`` (every
tensor dequantized by ``gguf.quants.dequantize``), within float32 rounding.

Each family's tiny GGUF is written by its own GGUF test's writer, then re-quantized tensor by tensor
(:func:`tiny_gguf.requantize`) to a mix of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 that differs from layer to
layer, so a stacked leaf's layers have different types and the layer scans must split by format.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from dflash_jax.drafter import model as drafter  # noqa: E402
from dflash_jax.families import registry  # noqa: E402
from dflash_jax.nn import quant  # noqa: E402
from quant_tiny import count_quantized  # noqa: E402
from tiny_gguf import requantize  # noqa: E402

LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def choose(name: str, shape: tuple):
    """A legacy type by the tensor's name (so layers differ), for 2-D+ weights of whole blocks;
    float vectors kept (and, in :func:`tiny_gguf.requantize`, tensors quantized already: MXFP4 experts)."""
    if not name.endswith(".weight") or len(shape) < 2 or shape[-1] % 32:
        return None
    return LEGACY[zlib.crc32(name.encode()) % len(LEGACY)]


def _greedy(m, cfg, params, prompt: np.ndarray, n: int):
    """(prefill logits [1, T, V], n greedy tokens) with the family's KV cache."""
    forward = jax.jit(m.forward, static_argnums=1)
    t = prompt.shape[1]
    cache = m.init_cache(cfg, 1, t + n)
    logits, cache, _ = forward(params, cfg, jnp.asarray(prompt), jnp.arange(t, dtype=jnp.int32)[None], cache)
    out, last = [], logits
    for i in range(n):
        tok = int(jnp.argmax(last[0, -1]))
        out.append(tok)
        last, cache, _ = forward(params, cfg, jnp.asarray([[tok]], jnp.int32), jnp.asarray([[t + i]], jnp.int32), cache)
    return np.asarray(logits), out


def _laguna_file(tmp_path):
    from laguna_tiny import PER_HEAD, tiny_laguna
    from test_laguna_gguf import write_laguna_gguf

    hf = dict(PER_HEAD, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              num_experts=16, num_hidden_layers=6, num_attention_heads_per_layer=[4, 8, 8, 4, 8, 8],
              layer_types=["full_attention", "sliding_attention", "sliding_attention"] * 2,
              mlp_layer_types=["dense"] + ["sparse"] * 5)
    cfg, params = tiny_laguna(hf, seed=5)
    return write_laguna_gguf(tmp_path / "f.gguf", hf, cfg, params), "laguna"


def _qwen3_moe_file(tmp_path):
    from hf_oracle import save_tiny
    from test_family_qwen3_moe import _COMMON, _write_gguf_from_hf

    conf = dict(_COMMON, num_experts=16, decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)
    save_tiny("Qwen3MoeConfig", "Qwen3MoeForCausalLM", tmp_path / "hf", seed=5, **conf)
    _write_gguf_from_hf(tmp_path / "hf", tmp_path / "f.gguf", conf)
    return tmp_path / "f.gguf", "qwen3_moe"


def _gpt_oss_file(tmp_path):
    from hf_oracle import save_tiny
    from test_family_gpt_oss import CONF, _write_gguf_from_hf

    conf = dict(CONF, num_local_experts=16, swiglu_limit=7.0, rope_parameters=dict(CONF["rope_parameters"], truncate=True))
    save_tiny("GptOssConfig", "GptOssForCausalLM", tmp_path / "hf", seed=6, **conf)
    _write_gguf_from_hf(tmp_path / "hf", tmp_path / "f.gguf", conf)
    return tmp_path / "f.gguf", "gpt_oss"


def _gemma4_file(tmp_path):
    from hf_oracle import save_tiny
    from test_family_gemma4 import MOE, _write_gguf_from_hf

    save_tiny("Gemma4TextConfig", "Gemma4ForCausalLM", tmp_path / "hf", seed=7, **MOE)
    _write_gguf_from_hf(tmp_path / "hf", tmp_path / "f.gguf")
    return tmp_path / "f.gguf", "gemma4"


def _qwen3_5_file(variant):
    def make(tmp_path):
        from test_family_qwen3_5_gguf import _save, _write_gguf

        _save(variant, str(tmp_path / "hf"))
        return _write_gguf(variant, str(tmp_path / "hf"), tmp_path / "f.gguf"), "qwen3_5"

    return make


def registry_loader(name):
    from dflash_jax.families.gemma4.gguf import load_gemma4_gguf_target
    from dflash_jax.families.gpt_oss.gguf import load_gpt_oss_gguf_target
    from dflash_jax.families.laguna.gguf import load_laguna_gguf_target
    from dflash_jax.families.qwen3_5.gguf import load_qwen3_5_gguf_target
    from dflash_jax.families.qwen3_moe.gguf import load_qwen3_moe_gguf_target

    return {"laguna": load_laguna_gguf_target, "qwen3_moe": load_qwen3_moe_gguf_target, "gpt_oss": load_gpt_oss_gguf_target,
            "gemma4": load_gemma4_gguf_target, "qwen3_5": load_qwen3_5_gguf_target}[name]


def one_type(name: str, shape: tuple):
    """Q8_0 for every 2-D+ weight of whole blocks (a family whose stacked layers must share a type)."""
    return "Q8_0" if choose(name, shape) else None


@pytest.mark.parametrize("make", [_laguna_file, _qwen3_moe_file, _gpt_oss_file, _gemma4_file, _qwen3_5_file("qwen3_5"),
                                  _qwen3_5_file("qwen3_next")],
                         ids=["laguna", "qwen3_moe", "gpt_oss", "gemma4", "qwen3_5", "qwen3_next"])
def test_quantized_gguf_equals_the_float_load_of_the_same_file(make, tmp_path):
    src, fam = make(tmp_path)
    types = requantize(src, tmp_path / "q.gguf", one_type if fam == "qwen3_5" else choose)
    assert len({t for t in types.values() if t in LEGACY}) >= (1 if fam == "qwen3_5" else 3)
    fcfg, fparams = registry_loader(fam)(tmp_path / "q.gguf", weights="float")
    qcfg, qparams = registry_loader(fam)(tmp_path / "q.gguf", weights="quantized")
    assert count_quantized(fparams) == 0 and count_quantized(qparams) >= 8
    m = registry.module_for(qcfg)
    leaves = jax.tree_util.tree_leaves_with_path(qparams, is_leaf=quant.is_quantized)
    experts = [w for p, w in leaves if jax.tree_util.keystr(p).endswith("['e_gate']")]
    if experts:
        assert all(quant.is_quantized(w) for w in experts)
        if fam == "gpt_oss":
            assert {w.format for w in experts} == {"mxfp4"}
    if fam in ("laguna", "qwen3_moe", "gpt_oss"):  # stacked layers: the scans split where the layers' types differ
        import importlib

        segments = importlib.import_module(m.module).segments
        assert len(segments(qcfg)) > len(segments(fcfg)) and qcfg.weight_formats and not fcfg.weight_formats
    prompt = np.random.default_rng(2).integers(0, fcfg.vocab_size, (1, 7)).astype(np.int32)
    lq, tq = _greedy(m, qcfg, qparams, prompt, 5)
    lf, tf = _greedy(m, fcfg, fparams, prompt, 5)
    np.testing.assert_allclose(lq, lf, rtol=1e-4, atol=1e-4)
    assert tq == tf


@pytest.mark.parametrize("layout", ["ik", "mainline"])
def test_a_q8_0_laguna_drafter_gguf_drafts_as_its_float_load(layout, tmp_path):
    """The Laguna drafter's GGUF (both layouts) re-quantized to Q8_0 loads with its matrices
    quantized, and its context K/V, hidden states and draft logits equal the float load's."""
    from dflash_jax.drafter.laguna import load_laguna_drafter_gguf
    from laguna_tiny import LAGUNA_DRAFTER, PER_HEAD, tiny_laguna
    from test_laguna_drafter import write_gguf

    cfg_t, params_t = tiny_laguna(PER_HEAD, seed=4, max_block=4)
    dcfg = drafter.drafter_config_from_hf(dict(LAGUNA_DRAFTER, intermediate_size=64))
    src = write_gguf(tmp_path / "d.gguf", dcfg, drafter.init_params(dcfg, jax.random.key(7), scale=0.3), layout)
    requantize(src, tmp_path / "q.gguf", lambda name, shape: "Q8_0" if len(shape) == 2 and shape[-1] % 32 == 0 else None)
    fcfg, fparams = load_laguna_drafter_gguf(tmp_path / "q.gguf", cfg_t, sliding_window=6, weights="float")
    qcfg, qparams = load_laguna_drafter_gguf(tmp_path / "q.gguf", cfg_t, sliding_window=6, weights="quantized")
    assert qcfg == fcfg and count_quantized(fparams) == 0
    assert quant.is_quantized(qparams["fc"]) and all(quant.is_quantized(qparams["layers"][k]) for k in ("wq", "wk", "wo", "w_down"))
    model = registry.module_for(cfg_t)
    ctx = jnp.asarray(np.random.default_rng(1).normal(size=(1, 5, 2 * cfg_t.hidden_size)), jnp.float32)

    @jax.jit
    def run(dparams):
        k, v = drafter.context_kv(dparams, qcfg, ctx, jnp.arange(5, dtype=jnp.int32)[None])
        m = qcfg.mask_token_id
        block, bpos = jnp.asarray([[3, m, m, m]]), 5 + jnp.arange(4, dtype=jnp.int32)[None]
        h = drafter.forward(dparams, qcfg, model, params_t, cfg_t, block, bpos, k, v, jnp.asarray([5]))
        return k, v, h, drafter.logits(dparams, qcfg, model, params_t, cfg_t, h)

    for a, b in zip(run(qparams), run(fparams)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
