"""Dense target checkpoints (HF safetensors: Llama, Mistral, Qwen2, Qwen3) -> a
:class:`~dflash_jax.families.dense.config.TargetConfig` and the params of
:mod:`dflash_jax.families.dense.model`, read tensor by tensor with
:mod:`dflash_jax.formats.checkpoint` (strict: every problem raises
:class:`~dflash_jax.errors.DFlashError` naming the file and, where there is one, the tensor).

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` whose ``weight_map`` names a shard per tensor.
"""

from __future__ import annotations

import os
from typing import Any

from dflash_jax.families.hf_config import read_json
from dflash_jax.families.dense.config import TargetConfig, target_config_from_hf
from dflash_jax.formats.checkpoint import (
    _IGNORED,
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    Checkpoint,
    load_named,
    numpy_dtype,
)


def hf_target_names(cfg: TargetConfig) -> dict[str, tuple[tuple[str, ...], int | None, bool]]:
    """The HF tensor names of a target: ``{hf_name: (pytree path, layer index or None, transpose)}``.

    Shared by Llama, Qwen2 and Qwen3 (they differ only in which optional tensors exist, which
    ``cfg`` records). ``transpose`` marks torch ``[out, in]`` linear weights.
    """
    names: dict[str, tuple[tuple[str, ...], int | None, bool]] = {
        "model.embed_tokens.weight": (("embed",), None, False),
        "model.norm.weight": (("norm",), None, False),
    }
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), None, True)
    per_layer = {**ATTENTION_NAMES, **MLP_NAMES}
    if cfg.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": ("bq", False), "self_attn.k_proj.bias": ("bk", False),
                          "self_attn.v_proj.bias": ("bv", False)})
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = ("bo", False)
    if cfg.mlp_bias:
        per_layer.update({"mlp.gate_proj.bias": ("b_gate", False), "mlp.up_proj.bias": ("b_up", False),
                          "mlp.down_proj.bias": ("b_down", False)})
    if cfg.qk_norm:
        per_layer.update(QK_NORM_NAMES)
    for i in range(cfg.num_hidden_layers):
        for suffix, (leaf, transpose) in per_layer.items():
            names[f"model.layers.{i}.{suffix}"] = (("layers", leaf), i, transpose)
    return names


def _ignorable(name: str, cfg: TargetConfig) -> bool:
    # A tied checkpoint may still carry a copy of the embedding as lm_head.weight.
    return bool(_IGNORED.search(name)) or (cfg.tie_word_embeddings and name == "lm_head.weight")


def load_hf_target(folder: str | os.PathLike, dtype: Any = "float32", weights: str = "float") -> tuple[TargetConfig, dict]:
    """Loads a Llama / Qwen2 / Qwen3 HF checkpoint folder as ``(TargetConfig, params)``.

    Args:
      folder: holds ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``
        plus its shards.
      dtype: parameter dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``; stored F32/F16/BF16
        tensors are converted to it (``cfg.dtype`` is set to it too).
      weights: ``"float"``, ``"quantized"`` or ``"int8"``: FP8 linear weights kept FP8 or
        dequantized, float ones quantized to int8 or not (:mod:`dflash_jax.formats.quantized`).
    Returns:
      ``cfg`` and the params pytree of :mod:`dflash_jax.families.dense.model` as jax arrays of ``dtype``:
      linear weights transposed to ``[in, out]`` and layers stacked on a leading ``L`` axis; every
      leaf has the shape :func:`dflash_jax.families.dense.model.MODEL.param_shapes` gives.
    Raises:
      DFlashError: a bad ``config.json`` (names the file and field), an unsupported ``dtype``, no
        weights file, an index pointing to a missing shard, a truncated or corrupt safetensors
        file, or a missing, unexpected, mis-shaped or non-float tensor (names the file and tensor).
    """
    from dflash_jax.families.dense import model as dense

    folder = str(folder)
    target = numpy_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    cfg = target_config_from_hf(read_json(config_path), source=config_path).with_dtype(target.name)
    ckpt = Checkpoint(folder)
    params = load_named(ckpt, folder, hf_target_names(cfg), dense.MODEL.param_shapes(cfg), target,
                        lambda n: _ignorable(n, cfg), f"{cfg.family} target", weights=weights)
    return cfg, params
