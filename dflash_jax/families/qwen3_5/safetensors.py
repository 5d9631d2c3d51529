"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next hybrid checkpoints (HF safetensors) ->
:class:`~dflash_jax.families.qwen3_5.config.Qwen3_5Config` and the params of :mod:`dflash_jax.families.qwen3_5.model`,
read strictly tensor by tensor.

Names are transformers' (``save_pretrained`` of ``Qwen3_5ForCausalLM``: ``model.layers.{i}.``;
a ``Qwen3_5ForConditionalGeneration`` checkpoint's text part under ``model.language_model.``,
its ``model.visual.*`` and ``mtp.*`` tensors skipped). Three stored tensors are split and the
norms shifted on the way, through :class:`_Derived`, a view of the checkpoint that presents them
as the params' own tensors to :func:`dflash_jax.formats.checkpoint.load_named` (one strict name map):

* ``self_attn.q_proj.weight`` ``[Hq * 2D, H]``: per head ``D`` query rows then ``D`` gate rows;
* ``linear_attn.in_proj_qkv.weight`` ``[2 Hk dk + Hv dv, H]`` and ``linear_attn.conv1d.weight``
  ``[C, 1, K]``: query, key, value channels in that order;
* Qwen3-Next's ``linear_attn.in_proj_qkvz.weight`` / ``in_proj_ba.weight``: grouped per key
  head (:func:`_linear_names`);
* experts (Qwen3-Next, Qwen3.5-MoE): per-expert ``mlp.experts.{e}.gate_proj.weight`` ... (what
  ``save_pretrained`` writes), or stacked ``mlp.experts.gate_up_proj`` ``[E, 2 Im, H]`` (gate rows
  first) and ``mlp.experts.down_proj`` ``[E, H, Im]`` (the published Qwen3.5-MoE checkpoints);
* every ``Qwen3_5RMSNorm`` weight (layer norms, q/k norms, the final norm) is stored as ``w`` and
  applied as ``1 + w``: the params hold ``1 + w`` (computed in float32). The gated norm
  ``linear_attn.norm.weight`` is a plain weight.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable
import numpy as np
from dflash_jax.families.hf_config import read_json
from dflash_jax.families.qwen3_5.config import Qwen3_5Config, qwen3_5_config_from_hf
from dflash_jax.formats.checkpoint import MLP_NAMES, Checkpoint, TensorInfo, load_named, numpy_dtype


_SKIPPED = re.compile(r"^mtp\.|^model\.visual\.|(^|\.)rotary_emb\.inv_freq$")
_NORMS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm"}
_FULL = {"self_attn.k_proj.weight": ("wk", True), "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True)}
_LINEAR = {
    "linear_attn.A_log": ("a_log", False), "linear_attn.dt_bias": ("dt_bias", False),
    "linear_attn.norm.weight": ("gnorm", False), "linear_attn.out_proj.weight": ("wo", True),
}
_QWEN3_5_PROJ = {"linear_attn.in_proj_z.weight": ("wz", True), "linear_attn.in_proj_b.weight": ("wb", True),
                 "linear_attn.in_proj_a.weight": ("wa", True)}
_MOE = {"mlp.gate.weight": "router", "mlp.shared_expert.gate_proj.weight": "s_gate", "mlp.shared_expert.up_proj.weight": "s_up",
        "mlp.shared_expert.down_proj.weight": "s_down", "mlp.shared_expert_gate.weight": "s_router"}


def _shift(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) + 1.0


def _rows(lo: int, hi: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: x[lo:hi].reshape((hi - lo,) + x.shape[1:])


def _conv_rows(lo: int, hi: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: x[lo:hi, 0, :]


def _head_half(heads: int, d: int, half: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: x.reshape(heads, 2, d, x.shape[-1])[:, half].reshape(heads * d, x.shape[-1])


class _Derived:
    """A :class:`~dflash_jax.formats.checkpoint.Checkpoint` seen with derived tensors: each ``virtual name ->
    (stored name, stored shape it needs, transform, shape it gives)``; a stored tensor that is
    the source of derived ones is hidden (it would otherwise be unexpected). A stored tensor of
    another shape is presented with that shape, so the strict check names it and its shape."""

    def __init__(self, ckpt: Checkpoint, derived: dict[str, tuple[str, tuple, Callable, tuple]]):
        self.ckpt, self.files = ckpt, ckpt.files
        self.derived = {v: d for v, d in derived.items() if d[0] in ckpt.where}
        self.sources = {d[0] for d in self.derived.values()}

    def names(self) -> list[str]:
        return [n for n in self.ckpt.names() if n not in self.sources] + list(self.derived)

    def file_of(self, name: str) -> str:
        return self.ckpt.file_of(self.derived[name][0] if name in self.derived else name)

    def info(self, name: str) -> TensorInfo:
        if name not in self.derived:
            return self.ckpt.info(name)
        src, need, _, gives = self.derived[name]
        real = self.ckpt.info(src)
        return TensorInfo(real.dtype, gives if real.shape == need else real.shape, real.start, real.end)

    def read(self, name: str) -> np.ndarray:
        if name not in self.derived:
            return self.ckpt.read(name)
        src, _, fn, _ = self.derived[name]
        return fn(self.ckpt.read(src))


def _grouped(groups: int, width: int, lo: int, hi: int) -> Callable[[np.ndarray], np.ndarray]:
    """Rows ``[lo, hi)`` of each of ``groups`` consecutive blocks of ``width`` rows, concatenated."""
    return lambda x: x.reshape(groups, width, x.shape[-1])[:, lo:hi].reshape(groups * (hi - lo), x.shape[-1])


def _linear_names(cfg: Qwen3_5Config, pre: str, j: int, names: dict, derived: dict) -> None:
    """Adds the Gated DeltaNet projections of linear layer row ``j`` (prefix ``pre``): Qwen3.5's
    ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, or Qwen3-Next's
    ``in_proj_qkvz`` (per key head: ``dk`` q, ``dk`` k, ``r dv`` v, ``r dv`` z rows, ``r = Hv / Hk``)
    and ``in_proj_ba`` (per key head: ``r`` b rows, ``r`` a rows); the conv weight split in both."""
    H, hk, dk, dv, K = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    kd, vd, r = hk * dk, cfg.linear_num_value_heads * dv, cfg.linear_num_value_heads // hk
    conv = pre + "linear_attn.conv1d.weight"
    for leaf, lo, hi in (("q", 0, kd), ("k", kd, 2 * kd), ("v", 2 * kd, 2 * kd + vd)):
        names[f"{conv}[{leaf}]"] = (("linear", "conv_" + leaf), j, True)
        derived[f"{conv}[{leaf}]"] = (conv, (cfg.conv_dim, 1, K), _conv_rows(lo, hi), (hi - lo, K))
    if cfg.variant != "qwen3_next":
        qkv = pre + "linear_attn.in_proj_qkv.weight"
        for leaf, lo, hi in (("q", 0, kd), ("k", kd, 2 * kd), ("v", 2 * kd, 2 * kd + vd)):
            names[f"{qkv}[{leaf}]"] = (("linear", "w" + leaf), j, True)
            derived[f"{qkv}[{leaf}]"] = (qkv, (cfg.conv_dim, H), _rows(lo, hi), (hi - lo, H))
        names.update({pre + s: (("linear", leaf), j, t) for s, (leaf, t) in _QWEN3_5_PROJ.items()})
        return
    qkvz, ba, w = pre + "linear_attn.in_proj_qkvz.weight", pre + "linear_attn.in_proj_ba.weight", 2 * dk + 2 * r * dv
    for leaf, lo, hi in (("q", 0, dk), ("k", dk, 2 * dk), ("v", 2 * dk, 2 * dk + r * dv), ("z", 2 * dk + r * dv, w)):
        names[f"{qkvz}[{leaf}]"] = (("linear", "w" + leaf), j, True)
        derived[f"{qkvz}[{leaf}]"] = (qkvz, (hk * w, H), _grouped(hk, w, lo, hi), (hk * (hi - lo), H))
    for leaf, lo, hi in (("b", 0, r), ("a", r, 2 * r)):
        names[f"{ba}[{leaf}]"] = (("linear", "w" + leaf), j, True)
        derived[f"{ba}[{leaf}]"] = (ba, (2 * hk * r, H), _grouped(hk, 2 * r, lo, hi), (hk * r, H))


def _expert(e: int, lo: int, hi: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: x[e, lo:hi]


def _mlp_names(cfg: Qwen3_5Config, pre: str, kind: str, j: int, names: dict, derived: dict, stacked: bool) -> None:
    """Adds the MLP tensors of row ``j`` of ``kind``: the SwiGLU's, or the MoE's (per-expert
    names, or, when ``stacked``, each expert's slices of ``gate_up_proj`` / ``down_proj``)."""
    if not cfg.sparse:
        names.update({pre + s: ((kind, leaf), j, t) for s, (leaf, t) in MLP_NAMES.items()})
        return
    names.update({pre + s: ((kind, leaf), j, True) for s, leaf in _MOE.items()})
    E, H, Im = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for e in range(E if stacked else 0):
        for src, leaf, lo, hi, rows, need in (("gate_up_proj", "e_gate", 0, Im, Im, (E, 2 * Im, H)),
                                              ("gate_up_proj", "e_up", Im, 2 * Im, Im, (E, 2 * Im, H)),
                                              ("down_proj", "e_down", 0, H, H, (E, H, Im))):
            name = f"{pre}mlp.experts.{src}[{leaf}][{e}]"
            names[name] = ((kind, leaf), (j, e), True)
            derived[name] = (f"{pre}mlp.experts.{src}", need, _expert(e, lo, hi), (rows, need[2]))
    for e in range(0 if stacked else E):
        for proj, leaf in (("gate_proj", "e_gate"), ("up_proj", "e_up"), ("down_proj", "e_down")):
            names[f"{pre}mlp.experts.{e}.{proj}.weight"] = ((kind, leaf), (j, e), True)


def checkpoint_names(cfg: Qwen3_5Config, prefix: str = "model.", stacked: bool = False) -> tuple[dict, dict]:
    """``(names, derived)``: ``{tensor name: (pytree path, layer row or None, transpose)}`` for
    :func:`~dflash_jax.formats.checkpoint.load_named`, and the :class:`_Derived` entries it reads through
    (module docstring). ``prefix``: ``"model."`` or ``"model.language_model."``; ``stacked``:
    the experts are stored stacked (``mlp.experts.gate_up_proj``)."""
    H, nh, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    names: dict = {prefix + "embed_tokens.weight": (("embed",), None, False), prefix + "norm.weight+1": (("norm",), None, False)}
    derived: dict = {prefix + "norm.weight+1": (prefix + "norm.weight", (H,), _shift, (H,))}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), None, True)
    for kind, layers in (("linear", cfg.linear_layers), ("full", cfg.full_layers)):
        for j, i in enumerate(layers):
            pre = f"{prefix}layers.{i}."
            _mlp_names(cfg, pre, kind, j, names, derived, stacked)
            norms = dict(_NORMS, **({} if kind == "linear" else {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}))
            for s, leaf in norms.items():
                n = (D,) if "self_attn" in s else (H,)
                names[pre + s + "+1"] = ((kind, leaf), j, False)
                derived[pre + s + "+1"] = (pre + s, n, _shift, n)
            if kind == "linear":
                names.update({pre + s: ((kind, leaf), j, t) for s, (leaf, t) in _LINEAR.items()})
                _linear_names(cfg, pre, j, names, derived)
                continue
            names.update({pre + s: ((kind, leaf), j, t) for s, (leaf, t) in _FULL.items()})
            q = pre + "self_attn.q_proj.weight"
            for half, leaf in ((0, "wq"), (1, "wg")):
                names[f"{q}[{leaf}]"] = ((kind, leaf), j, True)
                derived[f"{q}[{leaf}]"] = (q, (2 * nh * D, H), _head_half(nh, D, half), (nh * D, H))
    return names, derived


def load_qwen3_5_target(folder: str | os.PathLike, dtype: Any = "float32", weights: str = "float") -> tuple[Qwen3_5Config, dict]:
    """Loads a Qwen3.5 HF checkpoint folder as ``(Qwen3_5Config, params)``.

    Args:
      folder: ``config.json`` and ``model.safetensors`` (or an index and its shards).
      dtype: parameter dtype name (``float32``, ``bfloat16``, ``float16``); ``cfg.dtype`` too.
      weights: ``"float"``, ``"quantized"`` or ``"int8"``: FP8 linear weights kept FP8 or
        dequantized, float ones quantized to int8 or not (:mod:`dflash_jax.formats.quantized`).
    Returns:
      ``cfg`` and the params of :mod:`dflash_jax.families.qwen3_5.model` (jax arrays; linear weights
      ``[in, out]``; layers stacked per type).
    Raises:
      DFlashError: a bad ``config.json`` (file and field named), an unsupported dtype, or a
        missing, unexpected, mis-shaped or non-float tensor (file and tensor named; a derived
        tensor is named ``stored name[part]`` or ``stored name+1``).
    """
    from dflash_jax.families.qwen3_5.model import MODEL

    folder = str(folder)
    target = numpy_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    cfg = qwen3_5_config_from_hf(read_json(config_path), config_path).with_dtype(target.name)
    ckpt = Checkpoint(folder)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in ckpt.names()) else "model."
    stacked = cfg.sparse and any(n.endswith("mlp.experts.gate_up_proj") for n in ckpt.names())
    names, derived = checkpoint_names(cfg, prefix, stacked)
    view = _Derived(ckpt, derived)

    def ignorable(n: str) -> bool:
        return bool(_SKIPPED.search(n)) or (cfg.tie_word_embeddings and n == "lm_head.weight")

    return cfg, load_named(view, folder, names, MODEL.param_shapes(cfg), target, ignorable, f"{cfg.family} target",
                           weights=weights)
