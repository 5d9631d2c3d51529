"""Writes a trained drafter in z-lab's checkpoint layout (``config.json`` + ``model.safetensors``).

The folder loads with :func:`dflash_jax.load_drafter` and with the reference
``dflash.model.DFlashDraftModel.from_pretrained`` (PyPI ``dflash==0.1.0``): a Qwen3-style
``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``num_target_layers`` and
``dflash_config: {block_size, mask_token_id, target_layer_ids}``; tensors named ``fc.weight``,
``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.*`` in torch ``[out, in]`` layout
(``docs/specs/dflash.md`` 1.2). No embedding or LM head is stored (the target's are used).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import jax
import ml_dtypes
import numpy as np

from dflash_jax.drafter import vocab as draft_vocab
from dflash_jax.formats.files import write_safetensors, write_text
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.errors import DFlashError
from dflash_jax.nn.module import tree_of

def _rope_fields(cfg: DrafterConfig) -> dict:
    r = cfg.rope
    out: dict = {"rope_theta": float(r.theta)}
    params: dict = {"rope_type": r.kind, "rope_theta": float(r.theta)}
    if r.kind == "linear":
        params["factor"] = float(r.factor)
    elif r.kind == "llama3":
        params.update(factor=float(r.factor), low_freq_factor=float(r.low_freq_factor), high_freq_factor=float(r.high_freq_factor),
                      original_max_position_embeddings=int(r.original_max_position_embeddings))
    if r.kind != "default":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    out["rope_parameters"] = params
    if r.partial != 1.0:
        out["partial_rotary_factor"] = float(r.partial)
    return out


def _attention_fields(cfg: DrafterConfig) -> dict:
    """``layer_types`` / ``sliding_window`` / ``is_causal`` reproducing ``layer_causal`` and
    ``layer_window`` under :func:`dflash_jax.drafter.config.dflash_drafter_config_from_hf`'s rules."""
    windows = sorted({w for w in cfg.layer_window if w > 0})
    if len(windows) > 1:
        raise DFlashError("drafter config: layer_window", f"several sliding windows {windows}", "one sliding_window for all sliding layers")
    types = ["sliding_attention" if w > 0 else "full_attention" for w in cfg.layer_window]
    out: dict = {"layer_types": types, "sliding_window": windows[0] if windows else None, "use_sliding_window": bool(windows)}
    implied = tuple(t == "sliding_attention" for t in types)
    if tuple(cfg.layer_causal) != implied:
        if len(set(cfg.layer_causal)) != 1:
            raise DFlashError("drafter config: layer_causal", f"{cfg.layer_causal} with layer types {types}",
                              "causal exactly on sliding layers, or the same causality for every layer (is_causal)")
        out["is_causal"] = bool(cfg.layer_causal[0])
    return out


def drafter_hf_config(cfg: DrafterConfig, dtype: str = "bfloat16", extra: Mapping | None = None) -> dict:
    """The z-lab ``config.json`` dict of a drafter (Qwen3 fields plus ``dflash_config``).

    Args:
      dtype: the stored weight dtype name (``torch_dtype`` / ``dtype`` fields).
      extra: free-form provenance merged at the top level (for example under ``"dflash_jax"``);
        it must not override a model field.
    Raises:
      DFlashError: an attention layout the config fields cannot express, or ``extra`` clashing.
    """
    dflash: dict = {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = cfg.input_embedding_scale
    if cfg.output_multiplier != 1.0:
        dflash["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping:
        dflash["final_logit_softcapping"] = cfg.final_logit_softcapping
    if cfg.post_norm_last:
        dflash["post_norm_last"] = True
    out = {
        "architectures": [cfg.architecture],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,
        "dflash_config": dflash,
        **_rope_fields(cfg),
        **_attention_fields(cfg),
    }
    for k, v in dict(extra or {}).items():
        if k in out:
            raise DFlashError(f"export extra field {k}", "clashes with a model config field", "a new top-level key")
        out[k] = v
    return out


def drafter_tensors(cfg: DrafterConfig, params, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """The drafter parameters (a parameter tree, or its module's ``nnx.State``, read as its tree)
    as z-lab tensors (``[out, in]`` layout) in ``dtype``.

    Inverse of :func:`dflash_jax.load_drafter`'s mapping (``drafter_names``).
    """
    from dflash_jax.drafter.generic import drafter_names

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    host = jax.tree_util.tree_map(lambda a: np.asarray(jax.device_get(a), np.float32), tree_of(params))
    out = {}
    for name, (path, layer, transpose) in drafter_names(cfg).items():
        a = host
        for p in path:
            a = a[p]
        if layer is not None:
            a = a[layer]
        if transpose:
            a = a.T
        out[name] = np.ascontiguousarray(a).astype(np_dtype)
    return out


def export_drafter(folder: str | os.PathLike, cfg: DrafterConfig, params, dtype: str = "bfloat16", extra: Mapping | None = None,
                   draft_ids=None) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` into ``folder`` (created; files replaced
    atomically).

    Args:
      cfg, params: the drafter (:mod:`dflash_jax.drafter.model` pytree, any float dtype, or
        its module's ``nnx.State``: :attr:`~dflash_jax.train.step.TrainState.params`).
      dtype: stored dtype, ``"bfloat16"`` (default), ``"float16"`` or ``"float32"``.
      extra: provenance fields for ``config.json`` (see :func:`drafter_hf_config`).
      draft_ids: optional ``[Vd]`` draft vocabulary, written to ``draft_vocab.safetensors``
        (:mod:`dflash_jax.drafter.vocab`); without it a stale file of an earlier export is removed.
    Returns:
      the folder path. Size: about ``2 * num_params`` bytes in bfloat16.
    """
    if dtype not in ("bfloat16", "float16", "float32"):
        raise DFlashError("export dtype", f"got {dtype!r}", "bfloat16, float16 or float32")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = drafter_hf_config(cfg, dtype, extra)
    write_safetensors(folder / "model.safetensors", drafter_tensors(cfg, params, dtype), {"format": "pt"})
    if draft_ids is not None:
        draft_vocab.save(folder, draft_vocab.check_ids(draft_ids, cfg.vocab_size, "draft_ids"))
    else:
        (folder / draft_vocab.FILE_NAME).unlink(missing_ok=True)
    write_text(folder / "config.json", json.dumps(hf, indent=2) + "\n")
    return folder
