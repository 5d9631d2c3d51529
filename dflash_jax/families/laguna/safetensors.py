"""Laguna target checkpoints (HF safetensors) -> :class:`LagunaConfig` and the params of
:mod:`dflash_jax.families.laguna.model`, read tensor by tensor.

Two name layouts are accepted (``docs/specs/laguna.md`` 4.1):

* **published** (the poolside repos): per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
  ``mlp.experts.e_score_correction_bias``, ``mlp.shared_expert.*``;
* **transformers** (``conversion_mapping.py`` ``"laguna"``, what ``save_pretrained`` writes):
  ``mlp.experts.gate_up_proj`` ``[E, 2*Im, H]`` (gate rows first), ``mlp.experts.down_proj``
  ``[E, H, Im]``, ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``.

The transformers layout is presented to :func:`dflash_jax.formats.checkpoint.load_named` as the published
names through :class:`~dflash_jax.formats.checkpoint.Renamed` (each expert a lazy slice of the fused memory-mapped tensor), so
one strict name map serves both. ``g_proj`` decides per-head vs per-element gating when the
config's ``gating`` is ``true`` or missing; an explicit contradicting string is an error. A
``g_proj`` with a stray singleton axis is squeezed. ``e_score_correction_bias`` stays float32.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
import numpy as np
from dflash_jax.families.hf_config import read_json
from dflash_jax.families.laguna.config import LagunaConfig, laguna_config_from_hf
from dflash_jax.errors import DFlashError
from dflash_jax.formats.checkpoint import (
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    Checkpoint,
    Renamed,
    numpy_dtype,
    load_named,
)


_ATTN = {**ATTENTION_NAMES, "self_attn.g_proj.weight": ("wg", True), **QK_NORM_NAMES}
_DENSE = MLP_NAMES
_SPARSE = {
    "mlp.gate.weight": ("router", True),
    "mlp.shared_expert.gate_proj.weight": ("s_gate", True),
    "mlp.shared_expert.up_proj.weight": ("s_up", True),
    "mlp.shared_expert.down_proj.weight": ("s_down", True),
}
_BIAS = "mlp.experts.e_score_correction_bias"
_EXPERT = {"gate_proj": "e_gate", "up_proj": "e_up", "down_proj": "e_down"}


def published_names(cfg: LagunaConfig) -> dict[str, tuple[tuple[str, str] | tuple[str], Any, bool]]:
    """``{published tensor name: (pytree path, index, transpose)}`` of every parameter.

    ``index`` is ``None``, the repetition index inside the layer's segment, or
    ``(repetition, expert)`` for per-expert weights (see :func:`dflash_jax.families.laguna.model.layer_slot`).
    """
    from dflash_jax.families.laguna.model import layer_slot

    names: dict = {"model.embed_tokens.weight": (("embed",), None, False), "model.norm.weight": (("norm",), None, False)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), None, True)
    for i in range(cfg.num_hidden_layers):
        key, r = layer_slot(cfg, i)
        pre = f"model.layers.{i}."
        per = dict(_ATTN, **(_DENSE if cfg.mlp_layer_types[i] == "dense" else _SPARSE))
        for suffix, (leaf, t) in per.items():
            names[pre + suffix] = ((key, leaf), r, t)
        if cfg.mlp_layer_types[i] == "sparse":
            names[pre + _BIAS] = ((key, "router_bias"), r, False)
            for e in range(cfg.num_experts):
                for proj, leaf in _EXPERT.items():
                    names[f"{pre}mlp.experts.{e}.{proj}.weight"] = ((key, leaf), (r, e), True)
    return names


def published_shapes(cfg: LagunaConfig) -> dict[str, tuple[int, ...]]:
    """``{published tensor name: stored (torch ``[out, in]``) shape}`` for ``cfg``."""
    from dflash_jax.families.laguna.model import MODEL

    shapes = MODEL.param_shapes(cfg)
    out = {}
    for name, (path, idx, t) in published_names(cfg).items():
        full = shapes[path[0]] if len(path) == 1 else shapes[path[0]][path[1]]
        n = 0 if idx is None else (len(idx) if isinstance(idx, tuple) else 1)
        s = tuple(full[n:])
        out[name] = tuple(reversed(s)) if t else s
    return out


def parameter_count(cfg: LagunaConfig) -> int:
    """Number of parameters of ``cfg`` (every published tensor, norms and router bias included)."""
    return int(sum(int(np.prod(s)) for s in published_shapes(cfg).values()))


def _views(cfg: LagunaConfig, ckpt: Checkpoint) -> Renamed:
    """Maps the transformers layout (and squeezable ``g_proj`` shapes) onto published names."""
    present = set(ckpt.names())
    views, hidden = {}, set()
    E, Im = cfg.num_experts, cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        g = pre + "self_attn.g_proj.weight"
        if g in present:
            shape = ckpt.info(g).shape
            if len(shape) > 2 and sum(d != 1 for d in shape) == 2:
                views[g] = (g, lambda a: a.reshape([d for d in a.shape if d != 1]), tuple(d for d in shape if d != 1))
                hidden.add(g)
        if cfg.mlp_layer_types[i] != "sparse":
            continue
        for a, b in (("mlp.shared_experts.", "mlp.shared_expert."),):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                real = f"{pre}{a}{proj}.weight"
                if real in present:
                    views[f"{pre}{b}{proj}.weight"] = (real, lambda x: x, ckpt.info(real).shape)
                    hidden.add(real)
        real = pre + "mlp.gate.e_score_correction_bias"
        if real in present:
            views[pre + _BIAS] = (real, lambda x: x, ckpt.info(real).shape)
            hidden.add(real)
        gu, dn = pre + "mlp.experts.gate_up_proj", pre + "mlp.experts.down_proj"
        if gu in present or dn in present:
            for real, want in ((gu, (E, 2 * Im, cfg.hidden_size)), (dn, (E, cfg.hidden_size, Im))):
                if real not in present:
                    raise DFlashError(f"{ckpt.file_of(gu if real == dn else dn)}: tensor {real}", "missing", "both fused expert tensors")
                if ckpt.info(real).shape != want:
                    raise DFlashError(f"{ckpt.file_of(real)}: tensor {real}", f"shape {ckpt.info(real).shape}", f"{want} for this config")
                hidden.add(real)
            for e in range(E):
                views[f"{pre}mlp.experts.{e}.gate_proj.weight"] = (gu, lambda x, e=e: x[e, :Im], (Im, cfg.hidden_size))
                views[f"{pre}mlp.experts.{e}.up_proj.weight"] = (gu, lambda x, e=e: x[e, Im:], (Im, cfg.hidden_size))
                views[f"{pre}mlp.experts.{e}.down_proj.weight"] = (dn, lambda x, e=e: x[e], (cfg.hidden_size, Im))
    return Renamed(ckpt, views, hidden)


def resolve_gating(cfg: LagunaConfig, gate_widths: dict[int, int], where) -> LagunaConfig:
    """Sets per-layer ``gate_per_head`` from the stored ``g_proj`` widths.

    Args:
      gate_widths: ``{layer: g_proj output rows}``.
      where: ``layer -> str`` naming the tensor for messages.
    Raises:
      DFlashError: a width that is neither ``nh`` nor ``nh * head_dim``, or one contradicting an
        explicit ``gating`` string.
    """
    gate = list(cfg.gate_per_head)
    for i, w in gate_widths.items():
        nh = cfg.heads_per_layer[i]
        if w == nh:
            per_head = True
        elif w == nh * cfg.head_dim:
            per_head = False
        else:
            raise DFlashError(where(i), f"{w} output rows", f"{nh} (per-head gate) or {nh * cfg.head_dim} (per-element gate)")
        if cfg.gating_explicit and per_head != cfg.gate_per_head[i]:
            kind = "per-head" if cfg.gate_per_head[i] else "per-element"
            raise DFlashError(where(i), f"{w} output rows contradict gating {kind!r} in config.json",
                              f"{nh if cfg.gate_per_head[i] else nh * cfg.head_dim} rows")
        gate[i] = per_head
    return dataclasses.replace(cfg, gate_per_head=tuple(gate))


def load_laguna_target(folder: str | os.PathLike, dtype: Any = "float32", cfg: LagunaConfig | None = None,
                      weights: str = "float") -> tuple[LagunaConfig, dict]:
    """Loads a Laguna HF checkpoint folder as ``(LagunaConfig, params)``, one tensor at a time.

    Args:
      folder: ``config.json`` plus ``model.safetensors`` or a sharded index (published or
        transformers tensor names, module docstring).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); the router's
        selection bias is kept in float32.
      cfg: use this config instead of parsing ``config.json`` (gating still checked).
      weights: ``"float"``, ``"quantized"`` or ``"int8"``: FP8 linear weights kept FP8 or
        dequantized, float ones quantized to int8 or not (:mod:`dflash_jax.formats.quantized`).
    Returns:
      The config (``gate_per_head`` from the ``g_proj`` widths) and the params of
      :mod:`dflash_jax.families.laguna.model`.
    Raises:
      DFlashError: bad config fields (file and field named), a gate width contradicting an
        explicit ``gating``, or missing / unexpected / mis-shaped tensors (file and tensor named).
    Source: ``docs/specs/laguna.md`` 4.1, transformers ``conversion_mapping.py``.
    """
    from dflash_jax.families.laguna import model as laguna

    folder = str(folder)
    target = numpy_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    if cfg is None:
        cfg = laguna_config_from_hf(read_json(config_path), source=config_path)
    cfg = cfg.with_dtype(target.name)
    ckpt = _views(cfg, Checkpoint(folder))
    present = set(ckpt.names())
    widths = {}
    for i in range(cfg.num_hidden_layers):
        g = f"model.layers.{i}.self_attn.g_proj.weight"
        if g in present:
            widths[i] = ckpt.info(g).shape[0]
    cfg = resolve_gating(cfg, widths, lambda i: f"{ckpt.file_of(f'model.layers.{i}.self_attn.g_proj.weight')}: tensor model.layers.{i}.self_attn.g_proj.weight")
    names = published_names(cfg)
    shapes = laguna.MODEL.param_shapes(cfg)
    bias_names = {n: v for n, v in names.items() if v[0][-1] == "router_bias"}
    main_names = {n: v for n, v in names.items() if n not in bias_names}
    main_shapes = {k: ({n: s for n, s in v.items() if n != "router_bias"} if isinstance(v, dict) else v) for k, v in shapes.items()}
    ignore_rope = lambda n: n.endswith("rotary_emb.inv_freq")  # noqa: E731
    params = load_named(ckpt, folder, main_names, main_shapes, target, lambda n: n in bias_names or ignore_rope(n), "Laguna target",
                        weights=weights)
    if bias_names:
        bias_shapes = {k: {"router_bias": v["router_bias"]} for k, v in shapes.items() if isinstance(v, dict) and "router_bias" in v}
        biases = load_named(ckpt, folder, bias_names, bias_shapes, np.dtype(np.float32), lambda n: n not in bias_names, "Laguna target")
        for k, v in biases.items():
            params[k]["router_bias"] = v["router_bias"]
    return cfg, params


def save_published(path: str | os.PathLike, cfg: LagunaConfig, params: dict) -> None:
    """Writes ``params`` as one safetensors file with the published tensor names (float32;
    for tests and fixtures). Inverse of :func:`load_laguna_target`."""
    from safetensors.numpy import save_file

    out = {}
    for name, (path_, idx, t) in published_names(cfg).items():
        leaf = params[path_[0]] if len(path_) == 1 else params[path_[0]][path_[1]]
        x = np.asarray(leaf, np.float32)
        if idx is not None:
            x = x[idx]
        out[name] = np.ascontiguousarray(x.T if t else x)
    save_file(out, str(path))
