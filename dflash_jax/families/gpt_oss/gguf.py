"""gpt-oss GGUF targets (llama.cpp ``general.architecture`` ``gpt-oss``) -> :class:`GptOssConfig`
and the params of :mod:`dflash_jax.families.gpt_oss.model`, one tensor at a time.

Layout facts (``gguf-py`` ``MODEL_TENSORS[GPT_OSS]`` / ``TensorNameMap`` and
``convert_hf_to_gguf.py``'s gpt-oss converter): per layer ``attn_norm``, ``attn_q``/``attn_k``/
``attn_v``/``attn_output`` with biases (torch ``[out, in]``; NeoX RoPE, no row permutation),
``attn_sinks [Hq]``, ``post_attention_norm`` (the norm before the MoE, HF
``post_attention_layernorm``), the router ``ffn_gate_inp`` ``[E, H]`` plus bias ``[E]``, and the
experts stacked per layer: ``ffn_gate_exps``/``ffn_up_exps`` ``[E, I, H]`` (HF's interleaved
``gate_up_proj`` split into its even and odd columns), ``ffn_down_exps`` ``[E, H, I]`` (numpy
order), with biases ``[E, I]``/``[E, I]``/``[E, H]``. Experts are usually ``MXFP4``, dequantized
by ``gguf.quants.dequantize`` (ggml's block: one E8M0 scale byte, then 16 bytes whose low nibbles
are values 0..15 and high nibbles 16..31; the same values as transformers' MXFP4 blocks, see
:func:`dflash_jax.families.gpt_oss.safetensors.dequantize_mxfp4`).

What llama.cpp's gpt-oss graph fixes, so the config does too: layers alternate sliding (even)
and full (odd) attention (``set_swa_pattern(2)``), the SwiGLU clamp is ``limit 7.0``,
``alpha 1.702`` (``ggml_swiglu_oai``), the top-k router logits are softmaxed. Its YaRN
correction range is always rounded to whole dimensions (``ggml_rope_yarn_corr_dims``), so a GGUF
loads with ``truncate`` true even where the HF config says false (the published gpt-oss configs
do: the logits then differ slightly from transformers', as llama.cpp's do). A rope scaling other
than YaRN or none, or a YaRN ``attn_factor``/``ext_factor`` other than 1, is refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
import numpy as np
from dflash_jax.families.hf_config import RopeConfig
from dflash_jax.families.gpt_oss.config import GptOssConfig
from dflash_jax.errors import DFlashError
from dflash_jax.families.dense.gguf import arch_config
from dflash_jax.formats.gguf_file import as_f32, embedding_vocab, metadata, open_gguf, read_params, tensor_table
from dflash_jax.formats.checkpoint import numpy_dtype
from dflash_jax.formats import gguf_leaves


ARCH = "gpt-oss"

# GGUF per-layer tensor -> (params leaf, how the numpy-order tensor becomes ours)
_LAYER = {
    "attn_norm.weight": ("attn_norm", None), "post_attention_norm.weight": ("mlp_norm", None),
    "attn_q.weight": ("wq", "T"), "attn_k.weight": ("wk", "T"), "attn_v.weight": ("wv", "T"), "attn_output.weight": ("wo", "T"),
    "attn_q.bias": ("bq", None), "attn_k.bias": ("bk", None), "attn_v.bias": ("bv", None), "attn_output.bias": ("bo", None),
    "attn_sinks.weight": ("sinks", None), "ffn_gate_inp.weight": ("router", "T"), "ffn_gate_inp.bias": ("router_bias", None),
    "ffn_gate_exps.weight": ("e_gate", "E"), "ffn_up_exps.weight": ("e_up", "E"), "ffn_down_exps.weight": ("e_down", "E"),
    "ffn_gate_exps.bias": ("eb_gate", None), "ffn_up_exps.bias": ("eb_up", None), "ffn_down_exps.bias": ("eb_down", None),
}


def _number(reader, path: str, key: str, default=None, positive: bool = True, integer: bool = False):
    value = metadata(reader, f"{ARCH}.{key}", default)
    ok = isinstance(value, (int,) if integer else (int, float)) and not isinstance(value, bool) and (value > 0 or not positive)
    if not ok:
        want = ("a positive " if positive else "a ") + ("integer" if integer else "number")
        raise DFlashError(f"{path}: metadata {ARCH}.{key}", "missing" if value is None else f"got {value!r}", want)
    return value if integer else as_f32(value)


def _rope(reader, path: str, theta: float) -> RopeConfig:
    """YaRN (or no scaling) from ``rope.scaling.*`` metadata, as llama.cpp runs it (module docstring)."""
    kind = metadata(reader, f"{ARCH}.rope.scaling.type")
    if kind in (None, "none"):
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise DFlashError(f"{path}: metadata {ARCH}.rope.scaling.type", f"unsupported value {kind!r}", "yarn or none")
    for key in ("rope.scaling.attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
        if _number(reader, path, key, 1.0) != 1.0:
            raise DFlashError(f"{path}: metadata {ARCH}.{key}", f"got {metadata(reader, f'{ARCH}.{key}')!r}", "1 (the YaRN transformers runs)")
    if _number(reader, path, "rope.scaling.yarn_log_multiplier", 0.0, positive=False) != 0.0:
        raise DFlashError(f"{path}: metadata {ARCH}.rope.scaling.yarn_log_multiplier", "nonzero", "absent or 0")
    return RopeConfig(theta=theta, kind="yarn", factor=_number(reader, path, "rope.scaling.factor"),
                      original_max_position_embeddings=_number(reader, path, "rope.scaling.original_context_length", integer=True),
                      beta_fast=_number(reader, path, "rope.scaling.yarn_beta_fast", 32.0),
                      beta_slow=_number(reader, path, "rope.scaling.yarn_beta_slow", 1.0), truncate=True)


def gpt_oss_gguf_config(reader, path: str, dtype: str = "float32") -> tuple[GptOssConfig, dict]:
    """:class:`GptOssConfig` from a ``gpt-oss`` GGUF's metadata and tensor list.

    Returns:
      ``(cfg, tensors by name)``: layers alternating sliding / full, SwiGLU limit 7 and alpha
      1.702, YaRN truncated (module docstring).
    Raises:
      DFlashError: another architecture, a missing or ill-typed key (``expert_count``,
        ``expert_used_count``, ``expert_feed_forward_length``, ``attention.sliding_window``, the
        YaRN keys), an unsupported rope scaling, or an embedding disagreeing with the tokenizer or
        ``vocab_size`` (file and key or tensor named).
    """
    _, meta = arch_config(reader, path, (ARCH,))
    tensors = tensor_table(reader, path)
    n = meta["layers"]
    if meta["rot_dim"] != meta["head_dim"]:
        raise DFlashError(f"{path}: metadata {ARCH}.rope.dimension_count", f"got {meta['rot_dim']}", f"key_length={meta['head_dim']}")
    cfg = GptOssConfig(
        vocab_size=embedding_vocab(reader, tensors, path, f"{ARCH}.vocab_size"), hidden_size=meta["hidden"],
        intermediate_size=_number(reader, path, "expert_feed_forward_length", integer=True), num_hidden_layers=n,
        num_attention_heads=meta["heads"], num_key_value_heads=meta["kv_heads"], head_dim=meta["head_dim"],
        num_experts=_number(reader, path, "expert_count", integer=True),
        num_experts_per_tok=_number(reader, path, "expert_used_count", integer=True),
        layer_types=tuple("full_attention" if i % 2 else "sliding_attention" for i in range(n)),
        sliding_window=_number(reader, path, "attention.sliding_window", integer=True), rope=_rope(reader, path, meta["theta"]),
        rms_norm_eps=meta["eps"], swiglu_limit=7.0, swiglu_alpha=1.702, tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=meta["ctx"], dtype=str(dtype),
    )
    return cfg, tensors


def gguf_names(cfg: GptOssConfig) -> dict[str, tuple[str, str, int | None, str | None]]:
    """``{GGUF tensor name: (params key, leaf or "", repetition or None, conversion)}`` of every
    parameter (conversion ``"T"``: transpose, ``"E"``: swap each expert's two axes)."""
    from dflash_jax.families.gpt_oss.model import layer_slot

    names = {"token_embd.weight": ("embed", "", None, None), "output_norm.weight": ("norm", "", None, None)}
    if not cfg.tie_word_embeddings:
        names["output.weight"] = ("lm_head", "", None, "T")
    for i in range(cfg.num_hidden_layers):
        key, r = layer_slot(cfg, i)
        names.update({f"blk.{i}.{base}": (key, leaf, r, conv) for base, (leaf, conv) in _LAYER.items()})
    return names


def load_gpt_oss_gguf_target(path: str | os.PathLike, dtype: Any = "float32", *, as_numpy: bool = False,
                             weights: str = "float") -> tuple[GptOssConfig, dict]:
    """Loads a ``gpt-oss`` GGUF as ``(GptOssConfig, params)``, one tensor at a time (no float32 cache).

    Args:
      path: the ``.gguf`` file (MXFP4, F32, F16, BF16, Q*_0 ... tensors: whatever
        :func:`dflash_jax.formats.gguf_file.dequantize_tensor` reads).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); weights are
        dequantized to float32, then cast; ``sinks`` stay float32.
      as_numpy: numpy leaves instead of jax arrays.
      weights: ``"float"``, or ``"quantized"`` (``"auto"``): quantized matrices stay quantized
        (MXFP4 experts as MXFP4; :func:`dflash_jax.formats.gguf_file.read_params`), layers stacked by
        their formats (``cfg.weight_formats``).
    Returns:
      The config and the params of :mod:`dflash_jax.families.gpt_oss.model`, equal to
      :func:`dflash_jax.families.gpt_oss.safetensors.load_gpt_oss_target` on the source safetensors.
    Raises:
      DFlashError: as :func:`gpt_oss_gguf_config`; a missing, unexpected or mis-shaped tensor
        (file and tensor named).
    """
    import jax

    from dflash_jax.families.gpt_oss.model import MODEL

    path, target = str(path), numpy_dtype(dtype)
    weights = gguf_leaves.check_weights(weights)
    cfg, tensors = gpt_oss_gguf_config(open_gguf(path), path, target.name)
    if weights == "quantized":
        cfg = dataclasses.replace(cfg, weight_formats=gguf_leaves.layer_formats(tensors, cfg.num_hidden_layers))
    out = read_params(path, tensors, gguf_names(cfg), MODEL.param_shapes(cfg), target, f"a {cfg.num_hidden_layers}-layer gpt-oss model",
                      dtype_of=lambda leaf: np.dtype(np.float32) if leaf == "sinks" else target, weights=weights)
    return cfg, (out if as_numpy else jax.device_put(out))
