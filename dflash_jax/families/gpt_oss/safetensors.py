"""gpt-oss target checkpoints (HF safetensors) -> :class:`GptOssConfig` and the params of
:mod:`dflash_jax.families.gpt_oss.model`, read tensor by tensor.

Expert tensors come in two layouts, both presented to :func:`dflash_jax.formats.checkpoint.load_named` as
virtual per-leaf names (:class:`~dflash_jax.formats.checkpoint.Renamed`):

* **dequantized** (what transformers 5.25 ``save_pretrained`` writes): ``mlp.experts.gate_up_proj``
  ``[E, H, 2I]`` (``[in, out]``, gate and up *interleaved*: gate columns ``0::2``, up ``1::2``),
  ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias [E, H]``;
* **MXFP4** (the published openai/gpt-oss-20b and -120b): ``gate_up_proj_blocks [E, 2I, H/32, 16]``
  and ``gate_up_proj_scales [E, 2I, H/32]`` (uint8; ``[out, in]``), likewise ``down_proj_*``;
  dequantized on load by :func:`dequantize_mxfp4`.

Source: transformers ``modeling_gpt_oss.py`` (``GptOssExperts``) and ``integrations/mxfp4.py``
(``FP4_VALUES``, ``_convert_moe_packed_tensors``).
"""

from __future__ import annotations

import os
from typing import Any
import numpy as np
from dflash_jax.families.hf_config import read_json
from dflash_jax.families.gpt_oss.config import GptOssConfig, gpt_oss_config_from_hf
from dflash_jax.errors import DFlashError
from dflash_jax.formats.checkpoint import ATTENTION_NAMES, Checkpoint, Renamed, load_named, numpy_dtype


# the FP4 (e2m1) value of each 4-bit code
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

_ATTN = dict(ATTENTION_NAMES, **{f"self_attn.{p}_proj.bias": (f"b{p}", False) for p in "qkvo"},
             **{"self_attn.sinks": ("sinks", False), "mlp.router.weight": ("router", True), "mlp.router.bias": ("router_bias", False)})
_EXPERT_LEAVES = ("e_gate", "e_up", "e_down", "eb_gate", "eb_up", "eb_down")
# quantization_config.quant_method values read here: the published MXFP4 experts (dequantized by
# the views below), and block-scaled FP8 through load_named.
_METHODS = ("fp8", "mxfp4")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32: ``blocks [..., G, 16]`` uint8 (two FP4 codes a byte, the low nibble
    first) and ``scales [..., G]`` uint8 (a power of two, bias 127) -> ``[..., G * 32]``.

    Raises:
      DFlashError: ``blocks`` and ``scales`` of mismatched shapes.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1:] != (16,):
        raise DFlashError("MXFP4 tensors", f"blocks {blocks.shape} and scales {scales.shape}", "blocks [..., G, 16], scales [..., G]")
    blocks = blocks.astype(np.uint8)
    vals = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def _expert_views(cfg: GptOssConfig, ckpt: Checkpoint, pre: str) -> dict:
    """Virtual names ``{pre}mlp.experts.{leaf}`` of one layer's expert leaves (module docstring)."""
    ex, present = pre + "mlp.experts.", set(ckpt.names())
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    views = {}
    for proj, (n_in, n_out), leaves in (("gate_up_proj", (H, 2 * I), ("e_gate", "e_up")), ("down_proj", (I, H), ("e_down",))):
        blocks, scales = ex + proj + "_blocks", ex + proj + "_scales"
        if blocks in present or scales in present:
            for real, want in ((blocks, (E, n_out, n_in // 32, 16)), (scales, (E, n_out, n_in // 32))):
                if real not in present or ckpt.info(real).shape != want:
                    got = "missing" if real not in present else f"shape {ckpt.info(real).shape}"
                    raise DFlashError(f"{ckpt.file_of(blocks if blocks in present else scales)}: tensor {real}", got, f"{want} for this config")
            real, read = (blocks, scales), lambda b, s: np.swapaxes(dequantize_mxfp4(b, s), 1, 2)
        else:
            real, read = ex + proj, lambda a: a
        if len(leaves) == 2:  # interleaved columns: gate 0::2, up 1::2
            views[ex + "e_gate"] = (real, lambda *a, r=read: r(*a)[..., 0::2], (E, H, I), "F32")
            views[ex + "e_up"] = (real, lambda *a, r=read: r(*a)[..., 1::2], (E, H, I), "F32")
        else:
            views[ex + "e_down"] = (real, read, (E, I, H), "F32")
    views[ex + "eb_gate"] = (ex + "gate_up_proj_bias", lambda a: a[..., 0::2], (E, I))
    views[ex + "eb_up"] = (ex + "gate_up_proj_bias", lambda a: a[..., 1::2], (E, I))
    views[ex + "eb_down"] = (ex + "down_proj_bias", lambda a: a, (E, H))
    for name, view in list(views.items()):  # absent real tensors: load_named names the leaf missing
        if not all(r in present for r in (view[0] if isinstance(view[0], tuple) else (view[0],))):
            del views[name]
    return views


def load_gpt_oss_target(folder: str | os.PathLike, dtype: Any = "float32", weights: str = "float") -> tuple[GptOssConfig, dict]:
    """Loads a gpt-oss HF checkpoint folder as ``(GptOssConfig, params)``, one tensor at a time.

    Args:
      folder: ``config.json`` plus ``model.safetensors`` or a sharded index (dequantized or
        MXFP4 experts, module docstring).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); ``sinks`` stay float32.
      weights: ``"float"``, ``"quantized"`` or ``"int8"``: FP8 linear weights kept FP8 or
        dequantized, float ones quantized to int8 or not (:mod:`dflash_jax.formats.quantized`).
    Returns:
      The config and the params of :mod:`dflash_jax.families.gpt_oss.model`.
    Raises:
      DFlashError: bad config fields (file and field named), or missing / unexpected /
        mis-shaped tensors, MXFP4 blocks without scales (file and tensor named).
    """
    from dflash_jax.families.gpt_oss import model as gpt_oss

    folder, target = str(folder), numpy_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    cfg = gpt_oss_config_from_hf(read_json(config_path), source=config_path).with_dtype(target.name)
    ckpt = Checkpoint(folder)
    views, hidden, names = {}, set(), {"model.embed_tokens.weight": (("embed",), None, False), "model.norm.weight": (("norm",), None, False)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), None, True)
    for i in range(cfg.num_hidden_layers):
        pre, (key, r) = f"model.layers.{i}.", gpt_oss.layer_slot(cfg, i)
        names.update({pre + suffix: ((key, leaf), r, t) for suffix, (leaf, t) in _ATTN.items()})
        layer_views = _expert_views(cfg, ckpt, pre)
        views.update(layer_views)
        hidden |= {n for v in layer_views.values() for n in (v[0] if isinstance(v[0], tuple) else (v[0],))}
        names.update({f"{pre}mlp.experts.{leaf}": ((key, leaf), r, False) for leaf in _EXPERT_LEAVES})
    shapes = gpt_oss.MODEL.param_shapes(cfg)
    sinks = {n: v for n, v in names.items() if v[0][-1] == "sinks"}
    main = {n: v for n, v in names.items() if n not in sinks}
    main_shapes = {k: ({n: s for n, s in v.items() if n != "sinks"} if isinstance(v, dict) else v) for k, v in shapes.items()}
    ckpt = Renamed(ckpt, views, hidden)
    ignore_rope = lambda n: n.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and n == "lm_head.weight")  # noqa: E731
    params = load_named(ckpt, folder, main, main_shapes, target, lambda n: n in sinks or ignore_rope(n), "gpt-oss target",
                        weights=weights, methods=_METHODS)
    sink_shapes = {k: {"sinks": v["sinks"]} for k, v in shapes.items() if isinstance(v, dict)}
    for k, v in load_named(ckpt, folder, sinks, sink_shapes, np.dtype(np.float32), lambda n: n not in sinks, "gpt-oss target",
                                methods=_METHODS).items():
        params[k]["sinks"] = v["sinks"]
    return cfg, params
