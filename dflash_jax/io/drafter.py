"""Loads z-lab DFlash drafter checkpoints (``config.json`` + safetensors) strictly.

Tensor names as stored by z-lab (``docs/specs/dflash.md`` 1.2): ``fc.weight``, ``hidden_norm.weight``,
``norm.weight`` and ``layers.{i}.*`` in Qwen3 naming; no embedding or LM head (the target's are
used). A ``model.`` prefix is accepted.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.config import DrafterConfig
from dflash_jax.errors import DFlashError
from dflash_jax.io.hf import ATTENTION_NAMES, MLP_NAMES, QK_NORM_NAMES, Checkpoint, load_named
from dflash_jax.models import dflash_drafter

_PER_LAYER = {**ATTENTION_NAMES, **QK_NORM_NAMES, **MLP_NAMES}
_BIASES = {f"self_attn.{p}_proj.bias": (f"b{p}", False) for p in "qkvo"}


def drafter_names(cfg: DrafterConfig, prefix: str = "") -> dict:
    """``{tensor name: (pytree path, layer index or None, transpose)}`` of a generic drafter."""
    names = {
        f"{prefix}fc.weight": (("fc",), None, True),
        f"{prefix}hidden_norm.weight": (("hidden_norm",), None, False),
        f"{prefix}norm.weight": (("norm",), None, False),
    }
    per_layer = dict(_PER_LAYER, **(_BIASES if cfg.attention_bias else {}))
    for i in range(cfg.num_hidden_layers):
        for suffix, (leaf, transpose) in per_layer.items():
            names[f"{prefix}layers.{i}.{suffix}"] = (("layers", leaf), i, transpose)
    return names


def load_dflash_drafter_weights(folder: str, cfg: DrafterConfig, target: np.dtype) -> tuple[DrafterConfig, dict]:
    """Reads the weights of a checked z-lab ``DFlashDraftModel`` config strictly (the folder's
    config is parsed and checked by :func:`dflash_jax.registry.load_hf_drafter`).

    Args:
      folder: holds ``model.safetensors`` (or a sharded index).
      cfg: its parsed config.
      target: parameter numpy dtype.
    Returns:
      ``(cfg, params)``: the params pytree of :mod:`dflash_jax.models.dflash_drafter`.
    Raises:
      DFlashError: an ``fc`` whose width is not ``len(target_layer_ids) * hidden_size``, or
        missing / unexpected / mis-shaped tensors (each message names the file and tensor).
    """
    ckpt = Checkpoint(folder)
    prefix = "model." if "model.fc.weight" in ckpt.names() else ""
    fc = f"{prefix}fc.weight"
    if fc in ckpt.names():
        shape = ckpt.info(fc).shape
        want = (cfg.hidden_size, len(cfg.target_layer_ids) * cfg.hidden_size)
        if shape != want:
            raise DFlashError(
                f"{ckpt.file_of(fc)}: tensor {fc}", f"shape {shape} does not fit {len(cfg.target_layer_ids)} captured layers",
                f"{want} = (hidden_size, len(target_layer_ids) * hidden_size)",
            )
    params = load_named(ckpt, folder, drafter_names(cfg, prefix), dflash_drafter.param_shapes(cfg), target,
                        lambda n: n.endswith("rotary_emb.inv_freq"), "DFlash drafter")
    return cfg, params
