"""The published Laguna configs (``config.json`` dicts) and the DFlash drafters' shapes.

Values from ``docs/specs/laguna.md`` 2.2 (copies of the HF files: XS-2.1 from the NVFP4-mlx repo at
rev 841778b, S-2.1 and M.1 from capacity-planner fixtures) and 6.2. Used for planning
(``tools/laguna_plan.py``) and the tensor-set contract tests; no weights are involved.
Drafter entries marked ``# assumed`` were not read from a real file (spec tags [I]/[S]).
"""

from __future__ import annotations


def _xs_like(hidden, layers, inter, swa_heads, experts_per_tok, moe, rope_full, max_pos):
    return {
        "architectures": ["LagunaForCausalLM"], "model_type": "laguna", "vocab_size": 100352, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 48,
        "num_attention_heads_per_layer": [48 if i % 4 == 0 else swa_heads for i in range(layers)],
        "num_key_value_heads": 8, "head_dim": 128,
        "layer_types": ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)],
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1), "sliding_window": 512, "num_experts": 256,
        "num_experts_per_tok": experts_per_tok, "moe_intermediate_size": moe, "shared_expert_intermediate_size": moe,
        "moe_routed_scaling_factor": 2.5, "gating": "per-head", "rms_norm_eps": 1e-6, "max_position_embeddings": max_pos,
        "tie_word_embeddings": False, "pad_token_id": 9, "bos_token_id": 2, "eos_token_id": [2, 24],
        "rope_parameters": {
            "full_attention": rope_full,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
    }


PUBLISHED = {
    "XS-2.1": _xs_like(2048, 40, 8192, 64, 8, 512, {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0, "original_max_position_embeddings": 8192,
        "beta_fast": 64.0, "beta_slow": 1.0, "attention_factor": 1.0, "partial_rotary_factor": 0.5}, 262144),
    "S-2.1": _xs_like(3072, 48, 12288, 72, 10, 1024, {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.4852030263919618, "partial_rotary_factor": 0.5}, 1048576),
    "M.1": {
        "architectures": ["LagunaForCausalLM"], "model_type": "laguna", "vocab_size": 100352, "hidden_size": 4096,
        "intermediate_size": 16384, "num_hidden_layers": 70, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 67, "num_experts": 256, "num_experts_per_tok": 16,
        "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024, "moe_routed_scaling_factor": 1.0,
        "gating": "per-element", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "rope_parameters": {"full_attention": {
            "rope_type": "yarn", "rope_theta": 500000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
            "beta_fast": 64.0, "beta_slow": 1.0, "attention_factor": 1.4158883, "partial_rotary_factor": 1.0}},
    },
}


def _drafter(layers, heads, inter, hidden, target_ids, n_target):
    return {
        "architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna", "num_hidden_layers": layers,
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": inter, "rms_norm_eps": 1e-6, "hidden_act": "silu", "vocab_size": 100352,
        "draft_vocab_size": 100352, "rope_theta": 500000.0, "layer_types": ["sliding_attention"] * layers,
        "sliding_window": 512, "gating": "per-head", "max_position_embeddings": 262144, "tie_word_embeddings": True,
        "dflash_config": {"block_size": 16, "mask_token_id": 12, "target_layer_ids": target_ids,
                          "num_target_layers": n_target, "causal": True},
    }


DRAFTERS = {
    "XS-2.1": _drafter(5, 64, 8192, 2048, [1, 13, 25, 33, 39], 40),  # target ids: mlx-lm default [S]
    "S-2.1": _drafter(6, 72, 12288, 3072, [1, 10, 19, 28, 37, 47], 48),  # assumed: intermediate [I], ids unknown
}
