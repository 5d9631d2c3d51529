"""The gpt_oss family against transformers' ``GptOssForCausalLM`` (tiny random checkpoint saved by
transformers 5, float32, CPU): logits (one pass, chunked prefill plus decode, captured layers) with
attention sinks, alternating sliding (window 5) and full layers, YaRN, biased router and experts and
a clamped SwiGLU whose clamp is reached; greedy plain and DFlash decoding (chains and trees) for one
and several prefill chunks; MXFP4 expert tensors dequantized as transformers' ``mxfp4`` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax.cache import init_capture  # noqa: E402
from dflash_jax.config_gpt_oss import GptOssConfig  # noqa: E402
from dflash_jax.io.gpt_oss import dequantize_mxfp4  # noqa: E402
from dflash_jax.models import gpt_oss  # noqa: E402
from dflash_jax.registry import load_hf_target  # noqa: E402
from dflash_jax.testing import tiny_drafter  # noqa: E402
from hf_oracle import hf_greedy, hf_logits, ours_greedy, save_tiny  # noqa: E402

V, TOL = 96, 1e-4
CONF = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.6, rms_norm_eps=1e-5,
            initializer_range=0.1, max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 16, "rope_theta": 150000.0})
_forward = jax.jit(gpt_oss.forward, static_argnums=1)


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = save_tiny("GptOssConfig", "GptOssForCausalLM", folder, seed=4, **CONF)
    cfg, params = load_hf_target(folder)
    return model, cfg, params, folder


def test_logits_and_capture_match_transformers(target):
    model, cfg, params, _ = target
    assert isinstance(cfg, GptOssConfig) and cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.rope.kind == "yarn"
    b, t, chunk = 2, 14, 5
    tokens = np.random.default_rng(7).integers(0, V, (b, t)).astype(np.int32)
    want = hf_logits(model, tokens)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    got, _, _ = _forward(params, cfg, jnp.asarray(tokens), pos, gpt_oss.init_cache(cfg, b, t + 2))
    assert _rel(got, want) < TOL
    with torch.no_grad():
        hidden = model(torch.from_numpy(tokens).long(), output_hidden_states=True, use_cache=False).hidden_states
    cache, out = gpt_oss.init_cache(cfg, b, t + 2), []
    capture = init_capture((0, 2), b, t, cfg.hidden_size, jnp.float32)
    for s in range(0, t, chunk):
        logits, cache, capture = _forward(params, cfg, jnp.asarray(tokens[:, s : s + chunk]), pos[:, s : s + chunk], cache, capture)
        out.append(logits)
    assert _rel(jnp.concatenate(out, axis=1), want) < TOL
    feats = np.asarray(capture.hidden).reshape(b, t, 2, cfg.hidden_size)
    assert _rel(feats[:, :, 0], hidden[1].numpy()) < TOL and _rel(feats[:, :, 1], hidden[3].numpy()) < TOL


def test_the_pieces_matter(target):
    """Guards against passing vacuously: without the sinks, the window or the clamp the logits differ."""
    import dataclasses

    model, cfg, params, _ = target
    tokens = np.random.default_rng(8).integers(0, V, (1, 14)).astype(np.int32)
    want = hf_logits(model, tokens)
    pos = jnp.arange(14, dtype=jnp.int32)[None]
    no_sinks = {k: dict(v, sinks=jnp.full_like(v["sinks"], -1e9)) if isinstance(v, dict) else v for k, v in params.items()}
    for p, c in ((no_sinks, cfg), (params, dataclasses.replace(cfg, sliding_window=0)), (params, dataclasses.replace(cfg, swiglu_limit=1e9))):
        got, _, _ = _forward(p, c, jnp.asarray(tokens), pos, gpt_oss.init_cache(c, 1, 14))
        assert _rel(got, want) > 1e-3


@pytest.mark.parametrize("chunk", [32, 3])
def test_greedy_plain_and_dflash_match_transformers(target, chunk):
    model, cfg, params, _ = target
    prompt, n = [3, 17, 42, 8, 11, 5, 29], 12
    want = hf_greedy(model, prompt, n)
    assert ours_greedy(cfg, params, prompt, n, chunk)[0] == want
    drafter = tiny_drafter(cfg, seed=1, layer_ids=(0, 2), block_size=4)
    assert ours_greedy(cfg, params, prompt, n, chunk, drafter)[0] == want
    if chunk == 3:
        assert ours_greedy(cfg, params, prompt, n, chunk, drafter, tree=3)[0] == want


def test_mxfp4_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rs = np.random.RandomState(0)
    blocks = rs.randint(0, 256, (3, 8, 2, 16)).astype(np.uint8)
    scales = rs.randint(120, 134, (3, 8, 2)).astype(np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    np.testing.assert_array_equal(np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2), want)


def test_mxfp4_checkpoint_loads(target, tmp_path):
    """A checkpoint whose experts are MXFP4 blocks and scales (the published layout) loads to the
    params of the same weights stored dequantized, and gives transformers' logits for them."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    import copy

    model, cfg, _, folder = target
    model = copy.deepcopy(model)  # the fixture's model stays as saved
    tensors = load_file(str(folder / "model.safetensors"))
    rs = np.random.RandomState(1)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            pre = f"model.layers.{i}.mlp.experts."
            for proj, (n_in, n_out) in (("gate_up_proj", (H, 2 * I)), ("down_proj", (I, H))):
                blocks = rs.randint(0, 256, (E, n_out, n_in // 32, 16)).astype(np.uint8)
                scales = rs.randint(118, 124, (E, n_out, n_in // 32)).astype(np.uint8)
                w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
                getattr(layer.mlp.experts, proj).copy_(w)
                del tensors[pre + proj]
                tensors[pre + proj + "_blocks"], tensors[pre + proj + "_scales"] = blocks, scales
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    q_cfg, q_params = load_hf_target(tmp_path)
    tokens = np.random.default_rng(3).integers(0, V, (1, 10)).astype(np.int32)
    got, _, _ = _forward(q_params, q_cfg, jnp.asarray(tokens), jnp.arange(10, dtype=jnp.int32)[None], gpt_oss.init_cache(q_cfg, 1, 10))
    assert _rel(got, hf_logits(model, tokens)) < TOL


def test_same_tokens_and_verify_steps_as_zlab_dflash_generate(target, tmp_path):
    """z-lab's reference loop on the transformers target and a steered drafter (blocks accepted)
    gives the tokens and verify steps ours gives on the loaded checkpoints."""
    zlab = pytest.importorskip("dflash.model")
    from hf_oracle import zlab_matches_ours

    model, cfg, params, _ = target
    zlab_matches_ours(zlab, model, cfg, params, tmp_path, [3, 17, 42, 8, 11, 5, 29], 24, V, 64)
