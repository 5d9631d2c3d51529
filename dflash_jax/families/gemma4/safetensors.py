"""Gemma 4 text target checkpoints (HF safetensors, ``Gemma4ForCausalLM``) -> :class:`Gemma4Config`
and the params of :mod:`dflash_jax.families.gemma4.model`, read tensor by tensor.

Tensor names: transformers 5.25 ``save_pretrained`` of ``Gemma4ForCausalLM`` (``model.`` prefix;
``model.layers.{i}.layer_scalar`` is a saved buffer of shape ``[1]``), or the text decoder of a
``Gemma4ForConditionalGeneration`` (``model.language_model.`` prefix; its vision and audio towers
and embedders, ``model.vision_tower.*``, ``model.audio_tower.*``, ``model.embed_vision.*``,
``model.embed_audio.*``, skipped). With the MoE block (Gemma 4 26B-A4B) each layer adds
``router.{proj.weight,scale,per_expert_scale}``, ``pre_feedforward_layernorm_2``,
``post_feedforward_layernorm_{1,2}`` and the fused ``experts.gate_up_proj [E, 2*Im, H]`` (gate
rows first) and ``experts.down_proj [E, H, Im]``, as transformers saves them.
"""

from __future__ import annotations

import os
from typing import Any
from dflash_jax.families.hf_config import read_json
from dflash_jax.families.gemma4.config import Gemma4Config, gemma4_config_from_hf
from dflash_jax.errors import DFlashError
from dflash_jax.formats.checkpoint import MLP_NAMES, QK_NORM_NAMES, Checkpoint, Renamed, load_named, numpy_dtype


_LAYER = {
    "input_layernorm.weight": ("attn_norm", False), "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False), "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True), "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True), "layer_scalar": ("scalar", False), **MLP_NAMES, **QK_NORM_NAMES,
}
_PER_LAYER_INPUT = {"per_layer_input_gate.weight": ("pl_gate", True), "per_layer_projection.weight": ("pl_out", True),
                    "post_per_layer_input_norm.weight": ("post_pl_norm", False)}


_MOE = {"router.proj.weight": ("router", True), "router.scale": ("router_scale", False),
        "router.per_expert_scale": ("expert_scale", False), "post_feedforward_layernorm_1.weight": ("post_mlp_norm_1", False),
        "pre_feedforward_layernorm_2.weight": ("pre_moe_norm", False), "post_feedforward_layernorm_2.weight": ("post_moe_norm", False),
        "experts.gate": ("e_gate", False), "experts.up": ("e_up", False), "experts.down": ("e_down", False)}

_MULTIMODAL = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def hf_names(cfg: Gemma4Config, prefix: str = "model.") -> dict[str, tuple[tuple[str, ...], None, bool]]:
    """``{tensor name: (pytree path, None, transpose)}`` of every parameter (module docstring);
    ``prefix``: ``"model."`` or ``"model.language_model."``."""
    names: dict = {f"{prefix}embed_tokens.weight": (("embed",), None, False), f"{prefix}norm.weight": (("norm",), None, False)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), None, True)
    if cfg.per_layer_input:
        names.update({f"{prefix}embed_tokens_per_layer.weight": (("embed_pl",), None, False),
                      f"{prefix}per_layer_model_projection.weight": (("pl_proj",), None, True),
                      f"{prefix}per_layer_projection_norm.weight": (("pl_norm",), None, False)})
    for i in range(cfg.num_hidden_layers):
        per = dict(_LAYER, **(_PER_LAYER_INPUT if cfg.per_layer_input else {}), **(_MOE if cfg.num_experts else {}))
        if cfg.shares_kv(i):  # transformers builds no k/v projections or k norm on a KV-sharing layer
            per = {k: v for k, v in per.items() if v[0] not in ("wk", "wv", "k_norm")}
        elif cfg.k_eq_v(i):  # nor a v projection on a full layer under attention_k_eq_v
            per = {k: v for k, v in per.items() if v[0] != "wv"}
        for suffix, (leaf, t) in per.items():
            names[f"{prefix}layers.{i}.{suffix}"] = ((f"layer{i}", leaf), None, t)
    return names


def _expert_views(cfg: Gemma4Config, ckpt: Checkpoint, prefix: str) -> Renamed:
    """Each MoE layer's fused ``experts.gate_up_proj [E, 2*Im, H]`` (gate rows first) and
    ``experts.down_proj [E, H, Im]`` seen as the virtual ``experts.gate`` / ``experts.up``
    ``[E, H, Im]`` and ``experts.down [E, Im, H]`` (``[in, out]`` per expert)."""
    present, views, hidden = set(ckpt.names()), {}, set()
    E, Im, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for i in range(cfg.num_hidden_layers if cfg.num_experts else 0):
        gu, dn = f"{prefix}layers.{i}.experts.gate_up_proj", f"{prefix}layers.{i}.experts.down_proj"
        for real, want in ((gu, (E, 2 * Im, H)), (dn, (E, H, Im))):
            if real not in present:
                raise DFlashError(f"{sorted(ckpt.files)[0]}: tensor {real}", "missing", "the fused expert tensors of every MoE layer")
            if ckpt.info(real).shape != want:
                raise DFlashError(f"{ckpt.file_of(real)}: tensor {real}", f"shape {ckpt.info(real).shape}", f"{want} for this config")
            hidden.add(real)
        views[f"{prefix}layers.{i}.experts.gate"] = (gu, lambda x: x[:, :Im].transpose(0, 2, 1), (E, H, Im))
        views[f"{prefix}layers.{i}.experts.up"] = (gu, lambda x: x[:, Im:].transpose(0, 2, 1), (E, H, Im))
        views[f"{prefix}layers.{i}.experts.down"] = (dn, lambda x: x.transpose(0, 2, 1), (E, Im, H))
    return Renamed(ckpt, views, hidden)


def load_gemma4_target(folder: str | os.PathLike, dtype: Any = "float32", weights: str = "float") -> tuple[Gemma4Config, dict]:
    """Loads a Gemma 4 text HF checkpoint folder as ``(Gemma4Config, params)``, one tensor at a time.

    Args:
      folder: ``config.json`` plus ``model.safetensors`` or a sharded index (a text model, or a
        ``Gemma4ForConditionalGeneration``'s text decoder, module docstring).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
      weights: ``"float"``, ``"quantized"`` or ``"int8"``: FP8 linear weights kept FP8 or
        dequantized, float ones quantized to int8 or not (:mod:`dflash_jax.formats.quantized`).
    Returns:
      The config and the params of :mod:`dflash_jax.families.gemma4.model` (every leaf the shape
      :func:`dflash_jax.families.gemma4.model.MODEL.param_shapes` gives).
    Raises:
      DFlashError: bad or unsupported config fields (file and field named), or missing /
        unexpected / mis-shaped tensors (file and tensor named).
    Source: transformers ``modeling_gemma4.py`` (``Gemma4ForCausalLM``) parameter names.
    """
    from dflash_jax.families.gemma4 import model as gemma4

    folder = str(folder)
    target = numpy_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    cfg = gemma4_config_from_hf(read_json(config_path), source=config_path).with_dtype(target.name)

    ckpt = Checkpoint(folder)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in ckpt.names()) else "model."
    ckpt = _expert_views(cfg, ckpt, prefix)

    def ignorable(n: str) -> bool:  # rotary tables, other modalities, and a tied checkpoint's copy of the embedding
        return n.endswith("inv_freq") or n.startswith(_MULTIMODAL) or (cfg.tie_word_embeddings and n == "lm_head.weight")

    return cfg, load_named(ckpt, folder, hf_names(cfg, prefix), gemma4.MODEL.param_shapes(cfg), target, ignorable, "Gemma 4 target",
                           weights=weights)
