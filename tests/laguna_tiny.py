"""Tiny random Laguna targets and drafters shared by the Laguna tests (no files needed)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.families.laguna.config import laguna_config_from_hf
from dflash_jax.families.laguna import model as laguna

# Sliding window shorter than the prompts, YaRN with partial rotary on full layers, per-head gate,
# dense then sparse layers, per-layer head counts.
PER_HEAD = dict(
    architectures=["LagunaForCausalLM"], model_type="laguna", vocab_size=96, hidden_size=32, intermediate_size=48,
    num_hidden_layers=4, num_attention_heads=4, num_attention_heads_per_layer=[4, 8, 8, 4], num_key_value_heads=2,
    head_dim=8, layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=5, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=12, shared_expert_intermediate_size=16, moe_routed_scaling_factor=2.5, gating="per-head",
    rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
    rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0, "original_max_position_embeddings": 64,
                           "beta_fast": 64.0, "beta_slow": 1.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
)

# Per-element gate, explicit YaRN attention_factor, full rotary on full layers, sliding first.
PER_ELEMENT = dict(
    PER_HEAD, num_hidden_layers=3, num_attention_heads_per_layer=[4, 4, 8],
    layer_types=["sliding_attention", "full_attention", "sliding_attention"], mlp_layer_types=["dense", "dense", "sparse"],
    gating="per-element", sliding_window=4,
    rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                           "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.25, "partial_rotary_factor": 1.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
)


def tiny_laguna(hf: dict = PER_HEAD, seed: int = 0, max_block: int = 4, scale: float = 0.25):
    """``(cfg, params)`` of a random tiny Laguna target (ring = window + ``max_block`` rows)."""
    cfg = dataclasses.replace(laguna_config_from_hf(hf), max_block=max_block)
    return cfg, laguna.MODEL.init_params(cfg, jax.random.key(seed), scale=scale)


LAGUNA_DRAFTER = dict(
    architectures=["DFlashLagunaForCausalLM"], model_type="laguna", hidden_size=32, intermediate_size=40,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96, rms_norm_eps=1e-6,
    hidden_act="silu", rope_theta=500000.0, layer_types=["sliding_attention"] * 2, sliding_window=6, gating="per-head",
    max_position_embeddings=256, tie_word_embeddings=True,
    dflash_config={"block_size": 4, "mask_token_id": 95, "target_layer_ids": [0, 2], "num_target_layers": 4, "causal": True},
)


def write_config(folder, cfg: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def recompute_greedy(params, cfg, prompt, n_new: int, buf: int) -> list[int]:
    """Greedy tokens by a full no-cache forward over a fixed ``buf``-long buffer each step
    (causal: the padding after the current token does not change its logits)."""
    fwd = jax.jit(lambda p, t: laguna.MODEL.forward(p, cfg, t, jnp.arange(buf, dtype=jnp.int32)[None], laguna.MODEL.init_cache(cfg, 1, buf))[0])
    toks = list(prompt)
    for _ in range(n_new):
        arr = np.zeros((1, buf), np.int32)
        arr[0, : len(toks)] = toks
        lg = fwd(params, jnp.asarray(arr))
        toks.append(int(np.argmax(np.asarray(lg[0, len(toks) - 1]))))
    return toks[len(prompt):]
