"""Mistral's ``sliding_window`` against transformers' ``MistralForCausalLM`` (tiny, float32, a window
shorter than the prompts): logits, chunked prefill, greedy plain and DFlash decoding."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax.families.dense.config import target_config_from_hf  # noqa: E402
from dflash_jax.errors import DFlashError  # noqa: E402
from dflash_jax.families.dense import model as dense  # noqa: E402
from dflash_jax.families.registry import load_hf_target  # noqa: E402
from dflash_jax.testing import tiny_drafter  # noqa: E402
from hf_oracle import hf_greedy, hf_logits, ours_greedy, save_tiny  # noqa: E402

WINDOW = 5
CONF = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-5, initializer_range=0.1, max_position_embeddings=128, sliding_window=WINDOW,
            tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral")
    model = save_tiny("MistralConfig", "MistralForCausalLM", folder, **CONF)
    cfg, params = load_hf_target(folder)
    return model, cfg, params


def test_window_parsed_and_logits_match(mistral):
    model, cfg, params = mistral
    assert cfg.sliding_window == WINDOW and cfg.family == "llama"
    tokens = np.random.default_rng(0).integers(0, 97, (2, 16)).astype(np.int32)
    want = hf_logits(model, tokens)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    got, _, _ = dense.MODEL.forward(params, cfg, jnp.asarray(tokens), pos, dense.MODEL.init_cache(cfg, 2, 20))
    assert np.abs(np.asarray(got) - want).max() / np.abs(want).max() < 1e-4
    unwindowed, _, _ = dense.MODEL.forward(params, dataclasses.replace(cfg, sliding_window=0), jnp.asarray(tokens), pos, dense.MODEL.init_cache(cfg, 2, 20))
    assert np.abs(np.asarray(unwindowed) - want).max() / np.abs(want).max() > 1e-3  # the window matters here


@pytest.mark.parametrize("chunk", [16, 3])
def test_greedy_plain_and_dflash_match_transformers(mistral, chunk):
    model, cfg, params = mistral
    prompt, n = [3, 17, 42, 8, 11, 5, 29, 60, 2], 14
    want = hf_greedy(model, prompt, n)
    assert ours_greedy(cfg, params, prompt, n, chunk)[0] == want
    drafter = tiny_drafter(cfg, seed=1, layer_ids=(0, 2), block_size=4)
    assert ours_greedy(cfg, params, prompt, n, chunk, drafter)[0] == want
    if chunk == 3:  # tree verification too (a tree's RoPE positions and mask; its accepted path moved)
        assert ours_greedy(cfg, params, prompt, n, chunk, drafter, tree=3)[0] == want


def test_window_fields():
    base = dict(CONF, architectures=["MistralForCausalLM"], model_type="mistral")
    assert target_config_from_hf(dict(base, sliding_window=None)).sliding_window == 0
    assert target_config_from_hf(dict(base, architectures=["LlamaForCausalLM"], model_type="llama")).sliding_window == 0
    with pytest.raises(DFlashError, match="config.json: field sliding_window"):
        target_config_from_hf(dict(base, sliding_window=-2))
    with pytest.raises(DFlashError, match="config.json: field use_sliding_window"):
        target_config_from_hf(dict(base, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True))


def test_a_tree_wider_than_the_window_is_refused(mistral):
    from dflash_jax.nn.attention import TreeBlock

    _, cfg, params = mistral
    t = WINDOW + 1
    tree = TreeBlock(depth=jnp.arange(t, dtype=jnp.int32)[None], mask=jnp.tril(jnp.ones((t, t), bool))[None])
    with pytest.raises(DFlashError, match="tree: 6 tokens in one verify pass.*sliding_window=5"):
        dense.forward_hidden(params, cfg, jnp.zeros((1, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], dense.MODEL.init_cache(cfg, 1, 8), tree=tree)
