"""Qwen3-MoE target checkpoints (HF safetensors) -> :class:`Qwen3MoeConfig` and the params of
:mod:`dflash_jax.families.qwen3_moe.model`, read tensor by tensor.

Two expert layouts are accepted:

* **per expert** (the published Qwen3-30B-A3B / Qwen3-Coder-30B-A3B repos, and what transformers
  5.25 ``save_pretrained`` writes): ``mlp.experts.{e}.{gate,up,down}_proj.weight``;
* **fused** (transformers 5's in-memory ``Qwen3MoeExperts``): ``mlp.experts.gate_up_proj``
  ``[E, 2*Im, H]`` (gate rows first) and ``mlp.experts.down_proj`` ``[E, H, Im]``, presented to
  :func:`dflash_jax.formats.checkpoint.load_named` as the per-expert names (:class:`~dflash_jax.formats.checkpoint.Renamed`).

The router is ``mlp.gate.weight [E, H]``; dense layers carry ``mlp.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import os
from typing import Any
from dflash_jax.families.hf_config import read_json
from dflash_jax.families.qwen3_moe.config import Qwen3MoeConfig, qwen3_moe_config_from_hf
from dflash_jax.errors import DFlashError
from dflash_jax.formats.checkpoint import (
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    Checkpoint,
    Renamed,
    load_named,
    numpy_dtype,
)


_EXPERT = {"gate_proj": "e_gate", "up_proj": "e_up", "down_proj": "e_down"}
_BIASES = {"self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv", "self_attn.o_proj.bias": "bo"}


def hf_names(cfg: Qwen3MoeConfig) -> dict[str, tuple[tuple[str, str] | tuple[str], Any, bool]]:
    """``{tensor name: (pytree path, index, transpose)}`` of every parameter (per-expert names);
    ``index`` is ``None``, the repetition inside the layer's segment, or ``(repetition, expert)``
    (:func:`dflash_jax.families.qwen3_moe.model.layer_slot`)."""
    from dflash_jax.families.qwen3_moe.model import layer_slot

    names: dict = {"model.embed_tokens.weight": (("embed",), None, False), "model.norm.weight": (("norm",), None, False)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), None, True)
    for i in range(cfg.num_hidden_layers):
        key, r = layer_slot(cfg, i)
        pre = f"model.layers.{i}."
        per = dict(ATTENTION_NAMES, **QK_NORM_NAMES, **({} if cfg.sparse_layers[i] else MLP_NAMES))
        if cfg.attention_bias:
            per.update({n: (leaf, False) for n, leaf in _BIASES.items()})
        for suffix, (leaf, t) in per.items():
            names[pre + suffix] = ((key, leaf), r, t)
        if cfg.sparse_layers[i]:
            names[pre + "mlp.gate.weight"] = ((key, "router"), r, True)
            for e in range(cfg.num_experts):
                for proj, leaf in _EXPERT.items():
                    names[f"{pre}mlp.experts.{e}.{proj}.weight"] = ((key, leaf), (r, e), True)
    return names


def _views(cfg: Qwen3MoeConfig, ckpt: Checkpoint) -> Renamed:
    """The fused expert tensors of each sparse layer seen as per-expert names."""
    present = set(ckpt.names())
    views, hidden = {}, set()
    E, Im, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        gu, dn = pre + "mlp.experts.gate_up_proj", pre + "mlp.experts.down_proj"
        if not cfg.sparse_layers[i] or (gu not in present and dn not in present):
            continue
        for real, want in ((gu, (E, 2 * Im, H)), (dn, (E, H, Im))):
            if real not in present:
                raise DFlashError(f"{ckpt.file_of(gu if real == dn else dn)}: tensor {real}", "missing", "both fused expert tensors")
            if ckpt.info(real).shape != want:
                raise DFlashError(f"{ckpt.file_of(real)}: tensor {real}", f"shape {ckpt.info(real).shape}", f"{want} for this config")
            hidden.add(real)
        for e in range(E):
            views[f"{pre}mlp.experts.{e}.gate_proj.weight"] = (gu, lambda x, e=e: x[e, :Im], (Im, H))
            views[f"{pre}mlp.experts.{e}.up_proj.weight"] = (gu, lambda x, e=e: x[e, Im:], (Im, H))
            views[f"{pre}mlp.experts.{e}.down_proj.weight"] = (dn, lambda x, e=e: x[e], (H, Im))
    return Renamed(ckpt, views, hidden)


def load_qwen3_moe_target(folder: str | os.PathLike, dtype: Any = "float32", weights: str = "float") -> tuple[Qwen3MoeConfig, dict]:
    """Loads a Qwen3-MoE HF checkpoint folder as ``(Qwen3MoeConfig, params)``, one tensor at a time.

    Args:
      folder: ``config.json`` plus ``model.safetensors`` or a sharded index (either expert
        layout, module docstring).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
      weights: ``"float"``, ``"quantized"`` or ``"int8"``: FP8 linear weights kept FP8 or
        dequantized, float ones quantized to int8 or not (:mod:`dflash_jax.formats.quantized`).
    Returns:
      The config and the params of :mod:`dflash_jax.families.qwen3_moe.model` (every leaf the shape
      :func:`dflash_jax.families.qwen3_moe.model.MODEL.param_shapes` gives).
    Raises:
      DFlashError: bad config fields (file and field named), or missing / unexpected /
        mis-shaped tensors, or only one of a layer's fused expert tensors (file and tensor named).
    Source: the published Qwen3-30B-A3B tensor names; transformers ``modeling_qwen3_moe.py``.
    """
    from dflash_jax.families.qwen3_moe import model as qwen3_moe

    folder = str(folder)
    target = numpy_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    cfg = qwen3_moe_config_from_hf(read_json(config_path), source=config_path).with_dtype(target.name)
    ckpt = _views(cfg, Checkpoint(folder))

    def ignorable(n: str) -> bool:  # rotary tables, and a tied checkpoint's copy of the embedding
        return n.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and n == "lm_head.weight")

    return cfg, load_named(ckpt, folder, hf_names(cfg), qwen3_moe.MODEL.param_shapes(cfg), target, ignorable, "Qwen3-MoE target",
                           weights=weights)
