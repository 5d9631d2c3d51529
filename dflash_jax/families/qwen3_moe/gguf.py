"""Qwen3-MoE GGUF targets (llama.cpp ``general.architecture`` ``qwen3moe``) -> :class:`Qwen3MoeConfig`
and the params of :mod:`dflash_jax.families.qwen3_moe.model`, one tensor at a time.

Layout facts (llama.cpp ``llama-arch.cpp`` / ``gguf-py`` ``MODEL_TENSORS[QWEN3MOE]`` and
``convert_hf_to_gguf.py``): per layer ``attn_norm``, ``attn_q``/``attn_k``/``attn_v``/``attn_output``
(torch ``[out, in]``; Qwen's NeoX RoPE, so no row permutation), ``attn_q_norm``/``attn_k_norm``,
``ffn_norm``, the router ``ffn_gate_inp [E, H]`` and the experts stacked per layer:
``ffn_gate_exps``/``ffn_up_exps`` ``[E, Im, H]``, ``ffn_down_exps`` ``[E, H, Im]`` (numpy order).
llama.cpp's ``qwen3moe`` graph runs every layer as MoE and always renormalises the top-k weights
(``build_moe_ffn(..., norm_w=true, ...)``), so a file with a dense layer, or with
``qwen3moe.expert_weights_norm`` false, is refused rather than run differently.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from dflash_jax.families.qwen3_moe.config import Qwen3MoeConfig
from dflash_jax.errors import DFlashError
from dflash_jax.families.dense.gguf import arch_config, rope_config
from dflash_jax.formats.gguf_file import embedding_vocab, metadata, open_gguf, read_params, tensor_table
from dflash_jax.formats.checkpoint import numpy_dtype
from dflash_jax.formats import gguf_leaves


ARCH = "qwen3moe"

# GGUF per-layer tensor -> (params leaf, how the numpy-order tensor becomes ours)
_LAYER = {
    "attn_norm.weight": ("attn_norm", None), "ffn_norm.weight": ("mlp_norm", None),
    "attn_q.weight": ("wq", "T"), "attn_k.weight": ("wk", "T"), "attn_v.weight": ("wv", "T"), "attn_output.weight": ("wo", "T"),
    "attn_q.bias": ("bq", None), "attn_k.bias": ("bk", None), "attn_v.bias": ("bv", None), "attn_output.bias": ("bo", None),
    "attn_q_norm.weight": ("q_norm", None), "attn_k_norm.weight": ("k_norm", None),
    "ffn_gate_inp.weight": ("router", "T"),
    "ffn_gate_exps.weight": ("e_gate", "E"), "ffn_up_exps.weight": ("e_up", "E"), "ffn_down_exps.weight": ("e_down", "E"),
}


def _int(reader, path: str, key: str) -> int:
    value = metadata(reader, f"{ARCH}.{key}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise DFlashError(f"{path}: metadata {ARCH}.{key}", "missing" if value is None else f"got {value!r}", "a positive integer")
    return value


def qwen3_moe_gguf_config(reader, path: str, dtype: str = "float32") -> tuple[Qwen3MoeConfig, dict]:
    """:class:`Qwen3MoeConfig` from a ``qwen3moe`` GGUF's metadata and tensor list.

    Returns:
      ``(cfg, tensors by name)``; every layer sparse, ``norm_topk_prob`` true (module docstring).
    Raises:
      DFlashError: another architecture, a missing or ill-typed key, unnormalised expert weights,
        a layer without a router (a dense layer), or an embedding disagreeing with the tokenizer
        or ``vocab_size`` (file and key or tensor named).
    """
    _, meta = arch_config(reader, path, (ARCH,))
    tensors = tensor_table(reader, path)
    if metadata(reader, f"{ARCH}.expert_weights_norm", True) is not True:
        raise DFlashError(f"{path}: metadata {ARCH}.expert_weights_norm", "false", "true (llama.cpp's qwen3moe renormalises)")
    for i in range(meta["layers"]):
        if f"blk.{i}.ffn_gate_inp.weight" not in tensors:
            raise DFlashError(f"{path}: tensor blk.{i}.ffn_gate_inp.weight", "missing (a dense layer?)",
                              "a router in every layer: llama.cpp's qwen3moe runs every layer as MoE")
    cfg = Qwen3MoeConfig(
        vocab_size=embedding_vocab(reader, tensors, path, f"{ARCH}.vocab_size"), hidden_size=meta["hidden"],
        intermediate_size=meta["ffn"], num_hidden_layers=meta["layers"], num_attention_heads=meta["heads"],
        num_key_value_heads=meta["kv_heads"], head_dim=meta["head_dim"], num_experts=_int(reader, path, "expert_count"),
        num_experts_per_tok=_int(reader, path, "expert_used_count"),
        moe_intermediate_size=_int(reader, path, "expert_feed_forward_length"), sparse_layers=(True,) * meta["layers"],
        norm_topk_prob=True, rms_norm_eps=meta["eps"], rope=rope_config(meta, None, path),
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        max_position_embeddings=meta["ctx"], dtype=str(dtype),
    )
    return cfg, tensors


def gguf_names(cfg: Qwen3MoeConfig) -> dict[str, tuple[str, str, int | None, str | None]]:
    """``{GGUF tensor name: (params key, leaf or "", repetition or None, conversion)}`` of every
    parameter (conversion ``"T"``: transpose, ``"E"``: swap each expert's two axes)."""
    from dflash_jax.families.qwen3_moe.model import MODEL, layer_slot

    shapes = MODEL.param_shapes(cfg)
    names = {"token_embd.weight": ("embed", "", None, None), "output_norm.weight": ("norm", "", None, None)}
    if not cfg.tie_word_embeddings:
        names["output.weight"] = ("lm_head", "", None, "T")
    for i in range(cfg.num_hidden_layers):
        key, r = layer_slot(cfg, i)
        for base, (leaf, conv) in _LAYER.items():
            if leaf in shapes[key]:
                names[f"blk.{i}.{base}"] = (key, leaf, r, conv)
    return names


def load_qwen3_moe_gguf_target(path: str | os.PathLike, dtype: Any = "float32", *, as_numpy: bool = False,
                               weights: str = "float") -> tuple[Qwen3MoeConfig, dict]:
    """Loads a ``qwen3moe`` GGUF as ``(Qwen3MoeConfig, params)``, one tensor at a time (no float32
    cache).

    Args:
      path: the ``.gguf`` file (any tensor type :func:`dflash_jax.formats.gguf_file.dequantize_tensor` reads).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); weights are
        dequantized to float32, then cast.
      as_numpy: numpy leaves instead of jax arrays.
      weights: ``"float"``, or ``"quantized"`` (``"auto"``): quantized matrices and the embedding
        stay quantized (:func:`dflash_jax.formats.gguf_file.read_params`), layers stacked by their
        formats (``cfg.weight_formats``).
    Returns:
      The config and the params of :mod:`dflash_jax.families.qwen3_moe.model`, equal to
      :func:`dflash_jax.families.qwen3_moe.safetensors.load_qwen3_moe_target` on the source safetensors.
    Raises:
      DFlashError: as :func:`qwen3_moe_gguf_config`; a missing, unexpected or mis-shaped tensor
        (file and tensor named).
    """
    import jax

    from dflash_jax.families.qwen3_moe.model import MODEL

    path, target = str(path), numpy_dtype(dtype)
    reader = open_gguf(path)
    weights = gguf_leaves.check_weights(weights)
    cfg, tensors = qwen3_moe_gguf_config(reader, path, target.name)
    if weights == "quantized":
        cfg = dataclasses.replace(cfg, weight_formats=gguf_leaves.layer_formats(tensors, cfg.num_hidden_layers))
    out = read_params(path, tensors, gguf_names(cfg), MODEL.param_shapes(cfg), target, f"a {cfg.num_hidden_layers}-layer qwen3moe model",
                      weights=weights)
    return cfg, (out if as_numpy else jax.device_put(out))
