"""Parity of the dense target against transformers on tiny random checkpoints (float32, CPU).

Each model is built with transformers, its norms and biases perturbed away from their trivial
initial values, saved with ``save_pretrained`` and loaded back through ``load_hf_target``: this
covers the HF loader and the forward (full, chunked prefill + decode, and hidden-state capture).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax.runtime.carry import init_capture  # noqa: E402
from dflash_jax.families.dense.safetensors import load_hf_target  # noqa: E402
from dflash_jax.families.dense import model as dense  # noqa: E402

B, T, CHUNK, TOL = 2, 20, 7, 1e-4

_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, initializer_range=0.1, max_position_embeddings=128)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 5000.0}

CASES = {
    "llama_llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False, rope_theta=1e6)),
}

_forward = jax.jit(dense.MODEL.forward, static_argnums=1)


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.smoke) if c == "llama_llama3_rope" else c for c in CASES])
def case(request, tmp_path_factory):
    """Builds, perturbs, saves and reloads one model; runs the transformers reference once."""
    conf_cls, model_cls, extra = CASES[request.param]
    torch.manual_seed(1234)
    hf_cfg = getattr(transformers, conf_cls)(**_COMMON, **extra, attn_implementation="eager")
    model = getattr(transformers, model_cls)(hf_cfg).eval()
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    cfg, params = load_hf_target(folder, dtype="float32")

    tokens = np.random.default_rng(7).integers(0, hf_cfg.vocab_size, (B, T)).astype(np.int32)
    pre_norm = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: pre_norm.append(out if torch.is_tensor(out) else out[0]))
    with torch.no_grad():
        out = model(torch.from_numpy(tokens).long(), output_hidden_states=True, use_cache=False)
    hook.remove()
    ref = {
        "logits": out.logits.float().numpy(),
        "hidden": [h.float().numpy() for h in out.hidden_states],
        "last_pre_norm": pre_norm[0].float().numpy(),
    }
    return request.param, cfg, params, tokens, ref


def test_config_parsed(case):
    name, cfg, params, _, _ = case
    family = name.split("_")[0]
    assert cfg.family == family and cfg.dtype == "float32"
    assert cfg.head_dim == (24 if family == "qwen3" else 16)
    assert cfg.rope.kind == ("llama3" if name == "llama_llama3_rope" else "default")
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.tie_word_embeddings == ("lm_head" not in params) == (name == "llama_tied")
    shapes = dense.MODEL.param_shapes(cfg)
    assert jax.tree_util.tree_map(lambda x: tuple(x.shape), params) == jax.tree_util.tree_map(
        tuple, shapes, is_leaf=lambda x: isinstance(x, tuple))


def assert_slots_written(cache, n):
    """Slots ``[0, n)`` of every row hold K/V and the rest are untouched (the cache keeps no length:
    the forward wrote exactly the first ``n`` positions)."""
    written = np.any(np.asarray(cache.k) != 0, axis=(0, 3, 4))  # [B, S]
    assert written[:, :n].all() and not written[:, n:].any()


def test_full_forward(case):
    _, cfg, params, tokens, ref = case
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, cache, _ = _forward(params, cfg, jnp.asarray(tokens), positions, dense.MODEL.init_cache(cfg, B, T + 4))
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert _rel(logits, ref["logits"]) < TOL
    assert_slots_written(cache, T)


def test_chunked_prefill_then_decode(case):
    _, cfg, params, tokens, ref = case
    cache = dense.MODEL.init_cache(cfg, B, T + 4)
    ids = tuple(range(cfg.num_hidden_layers))
    capture = init_capture(ids, B, T, cfg.hidden_size, jnp.float32)
    n_prefill = 2 * CHUNK
    out = []
    for s in range(0, n_prefill, CHUNK):
        pos = jnp.broadcast_to(jnp.arange(s, s + CHUNK, dtype=jnp.int32), (B, CHUNK))
        logits, cache, capture = _forward(params, cfg, jnp.asarray(tokens[:, s : s + CHUNK]), pos, cache, capture)
        out.append(logits)
    for t in range(n_prefill, T):
        pos = jnp.full((B, 1), t, jnp.int32)
        logits, cache, capture = _forward(params, cfg, jnp.asarray(tokens[:, t : t + 1]), pos, cache, capture)
        out.append(logits)
    assert _rel(jnp.concatenate(out, axis=1), ref["logits"]) < TOL
    assert_slots_written(cache, T)
    feats = np.asarray(capture.hidden).reshape(B, T, len(ids), cfg.hidden_size)
    for s, i in enumerate(ids[:-1]):
        assert _rel(feats[:, :, s], ref["hidden"][i + 1]) < TOL, f"layer {i}"
    assert _rel(feats[:, :, -1], ref["last_pre_norm"]) < TOL


def test_capture_matches_hidden_states(case):
    _, cfg, params, tokens, ref = case
    L = cfg.num_hidden_layers
    ids = (L - 1, 0, 1)  # out of order on purpose: features follow the listed order
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    capture = init_capture(ids, B, T, cfg.hidden_size, jnp.float32)
    _, _, capture = _forward(params, cfg, jnp.asarray(tokens), positions, dense.MODEL.init_cache(cfg, B, T), capture)
    feats = np.asarray(capture.hidden).reshape(B, T, len(ids), cfg.hidden_size)
    for s, i in enumerate(ids):
        want = ref["last_pre_norm"] if i == L - 1 else ref["hidden"][i + 1]
        assert _rel(feats[:, :, s], want) < TOL, f"layer {i}"
    # transformers' last hidden state is final-normed; the capture is the pre-norm residual.
    assert _rel(feats[:, :, 0], ref["hidden"][L]) > 1e-2


def test_capture_post_norm_reading_of_last_layer(case):
    """The post-norm option reads the last layer as transformers' ``hidden_states[L]`` (what
    z-lab's PyTorch reference feeds a drafter that taps layer L-1); other layers are unchanged."""
    _, cfg, params, tokens, ref = case
    L = cfg.num_hidden_layers
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    capture = init_capture((0, L - 1), B, T, cfg.hidden_size, jnp.float32, post_norm_last=True)
    _, _, capture = _forward(params, cfg, jnp.asarray(tokens), positions, dense.MODEL.init_cache(cfg, B, T), capture)
    feats = np.asarray(capture.hidden).reshape(B, T, 2, cfg.hidden_size)
    assert _rel(feats[:, :, 0], ref["hidden"][1]) < TOL
    assert _rel(feats[:, :, 1], ref["hidden"][L]) < TOL


def test_llama3_rope_scaling_matters(case):
    """Guards the llama3 case against passing vacuously: default RoPE must not match."""
    name, cfg, params, tokens, ref = case
    if name != "llama_llama3_rope":
        pytest.skip("llama3 rope case only")
    import dataclasses

    plain = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, kind="default"))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _, _ = _forward(params, plain, jnp.asarray(tokens), positions, dense.MODEL.init_cache(plain, B, T))
    assert _rel(logits, ref["logits"]) > 1e-3
