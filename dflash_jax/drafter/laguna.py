"""The Laguna DFlash drafter kind (``DFlashLagunaForCausalLM``): its parameters, context K/V and
checkpoints (safetensors and both GGUF layouts -> one param pytree).

Differences from the generic z-lab drafter (``docs/specs/laguna.md`` 6.4 and 6.6; reference: vLLM
``laguna_dflash.py`` + ``v1/spec_decode/dflash.py``):

* fusion: each captured slice gets its own RMSNorm (``aux_hidden_norms.j``) before
  ``concat -> fc -> hidden_norm``;
* context K/V: the fused context goes through each layer's ``input_layernorm`` before that
  layer's K/V projection, then ``k_norm`` and RoPE at the context tokens' absolute positions;
* every layer has a softplus output gate ``softplus(float32(h Wg))`` (per head or per element)
  on the attention output before ``o_proj``, ``h`` the normed layer input;
* block attention is causal (``dflash_config.causal``) and sliding layers limit every query to
  keys with ``q_pos - k_pos < sliding_window`` over ``[context | block]`` (vLLM's per-query window);
* ``qkv_proj`` is packed in the checkpoint (split by head counts at load time).

Parameter pytree (``[in, out]`` layout, layers stacked on ``Ld``)::

    {"fc": [K*H, H], "aux_norm": [K, H], "hidden_norm": [H], "norm": [H],
     "layers": {"attn_norm", "wq", "wk", "wv", "wo", "wg" [Ld, H, nh or nh*D], "q_norm", "k_norm",
                "mlp_norm", "w_gate", "w_up", "w_down"}}

Checkpoints:

* safetensors (``docs/specs/laguna.md`` 6.3): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``,
  ``aux_hidden_norms.{j}.weight``, ``layers.{i}.self_attn.qkv_proj.weight`` (packed rows
  ``q | k | v``; split ``q_proj/k_proj/v_proj`` also accepted), ``g_proj``, ``q_norm``, ``k_norm``,
  ``o_proj``, ``mlp.*``, the two layer norms; an optional ``model.`` prefix.
* GGUF, ik_llama.cpp ``dflash-draft`` (6.8 A): ``dflash_fc``, ``dflash_hidden_norm``,
  ``dflash_aux_hidden_norm.{j}``, ``output_norm``, ``blk.i.{attn_norm, post_attention_norm,
  attn_q, attn_k, attn_v, attn_output, attn_gate, attn_q_norm, attn_k_norm, ffn_gate, ffn_up,
  ffn_down}``; keys ``dflash-draft.*`` with raw ``dflash.target_layer_ids``.
* GGUF, mainline / poolside ``dflash`` (6.8 B): ``fc``, ``enc.aux_norm`` (ne ``{H, n_aux}``:
  numpy ``[n_aux, H]``), ``enc.output_norm`` (= ``hidden_norm``), ``output_norm``,
  ``blk.i.{..., ffn_norm}``; keys ``dflash.*`` with ``dflash.target_layers`` = layer id + 1 and
  ``tokenizer.ggml.mask_token_id``. No window key: the vLLM window (``sliding_window`` argument,
  default 512) is used.

A drafter without its per-aux norms or gates is refused with an error naming the missing tensors
(never a silent fallback to the generic drafter: that runs, and only acceptance collapses; B17).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import generic
from dflash_jax.drafter.config import LAGUNA_DRAFTER, DrafterConfig, check_drafter_fits
from dflash_jax.drafter.generic import context_heads
from dflash_jax.errors import DFlashError
from dflash_jax.families.hf_config import RopeConfig
from dflash_jax.formats.gguf_file import dequantize_tensor, metadata, open_gguf
from dflash_jax.formats.checkpoint import (
    ATTENTION_NAMES,
    MLP_NAMES,
    QK_NORM_NAMES,
    Checkpoint,
    load_named,
)
from dflash_jax.nn import params as P
from dflash_jax.nn import quant
from dflash_jax.nn.layer import rms_norm
from dflash_jax.nn.params import ParamSpec, decoder_layer, stacked

_PER_LAYER = {**ATTENTION_NAMES, "self_attn.g_proj.weight": ("wg", True), **QK_NORM_NAMES, **MLP_NAMES}


def laguna_drafter_names(cfg: DrafterConfig, prefix: str = "") -> dict:
    """``{tensor name: (pytree path, index, transpose)}`` with split q/k/v names."""
    names = {
        f"{prefix}fc.weight": (("fc",), None, True),
        f"{prefix}hidden_norm.weight": (("hidden_norm",), None, False),
        f"{prefix}norm.weight": (("norm",), None, False),
    }
    for j in range(len(cfg.target_layer_ids)):
        names[f"{prefix}aux_hidden_norms.{j}.weight"] = (("aux_norm",), j, False)
    for i in range(cfg.num_hidden_layers):
        for suffix, (leaf, t) in _PER_LAYER.items():
            names[f"{prefix}layers.{i}.{suffix}"] = (("layers", leaf), i, t)
    return names


def _refuse_missing(present: set, cfg: DrafterConfig, prefix: str, where: str, aux_fmt: str, gate_fmt: str) -> None:
    aux = [aux_fmt.format(p=prefix, j=j) for j in range(len(cfg.target_layer_ids))]
    gates = [gate_fmt.format(p=prefix, i=i) for i in range(cfg.num_hidden_layers)]
    missing = [n for n in aux + gates if n not in present]
    if missing:
        raise DFlashError(f"{where}: tensors {', '.join(missing)}",
                          "missing: a DFlashLagunaForCausalLM drafter needs one RMSNorm per captured layer and a softplus gate per layer",
                          "the per-aux norms (aux_hidden_norms.*) and gates (g_proj) of the checkpoint")


def _check_gate(cfg: DrafterConfig, width: int, where: str) -> DrafterConfig:
    nh, D = cfg.num_attention_heads, cfg.head_dim
    kind = "head" if width == nh else "element" if width == nh * D else None
    if kind is None:
        raise DFlashError(where, f"{width} output rows", f"{nh} (per-head) or {nh * D} (per-element)")
    if cfg.gating_explicit and kind != cfg.gate:
        raise DFlashError(where, f"{width} output rows contradict gating per-{cfg.gate}", f"{nh if cfg.gate == 'head' else nh * D} rows")
    return dataclasses.replace(cfg, gate=kind)


class _SplitQKV:
    """Presents ``qkv_proj`` as ``q_proj``/``k_proj``/``v_proj`` (rows ``q | k | v``) to load_named."""

    def __init__(self, ckpt: Checkpoint, cfg: DrafterConfig, prefix: str):
        self.ckpt, self.files, self.views, self.hidden = ckpt, ckpt.files, {}, set()
        qd, kd, H = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size
        for i in range(cfg.num_hidden_layers):
            real = f"{prefix}layers.{i}.self_attn.qkv_proj.weight"
            if real not in ckpt.names():
                continue
            if ckpt.info(real).shape != (qd + 2 * kd, H):
                raise DFlashError(f"{ckpt.file_of(real)}: tensor {real}", f"shape {ckpt.info(real).shape}",
                                  f"{(qd + 2 * kd, H)} = ((heads + 2 * kv_heads) * head_dim, hidden) with head_dim {cfg.head_dim}")
            self.hidden.add(real)
            for p, (a, b) in zip("qkv", ((0, qd), (qd, qd + kd), (qd + kd, qd + 2 * kd))):
                self.views[f"{prefix}layers.{i}.self_attn.{p}_proj.weight"] = (real, lambda x, a=a, b=b: x[a:b], (b - a, H))

    def names(self):
        return [n for n in self.ckpt.names() if n not in self.hidden] + list(self.views)

    def file_of(self, n):
        return self.ckpt.file_of(self.views[n][0] if n in self.views else n)

    def info(self, n):
        if n in self.views:
            return dataclasses.replace(self.ckpt.info(self.views[n][0]), shape=self.views[n][2])
        return self.ckpt.info(n)

    def read(self, n):
        if n in self.views:
            return self.views[n][1](self.ckpt.read(self.views[n][0]))
        return self.ckpt.read(n)


def load_laguna_drafter_safetensors(folder: str, cfg: DrafterConfig, target: np.dtype) -> tuple[DrafterConfig, dict]:
    """Reads a ``DFlashLagunaForCausalLM`` safetensors folder (module docstring) strictly.

    Raises:
      DFlashError: missing aux norms or gates (named), a ``qkv_proj`` that does not split by the
        head counts, a gate width contradicting ``gating``, or any missing / unexpected /
        mis-shaped tensor.
    """
    raw = Checkpoint(folder)
    prefix = "model." if "model.fc.weight" in raw.names() else ""
    ckpt = _SplitQKV(raw, cfg, prefix)
    present = set(ckpt.names())
    where = sorted(raw.files)[0] if len(raw.files) == 1 else folder
    _refuse_missing(present, cfg, prefix, where, "{p}aux_hidden_norms.{j}.weight", "{p}layers.{i}.self_attn.g_proj.weight")
    g0 = f"{prefix}layers.0.self_attn.g_proj.weight"
    cfg = _check_gate(cfg, ckpt.info(g0).shape[0], f"{ckpt.file_of(g0)}: tensor {g0}")
    params = load_named(ckpt, folder, laguna_drafter_names(cfg, prefix), param_shapes(cfg), target,
                        lambda n: n.endswith("rotary_emb.inv_freq"), "DFlashLagunaForCausalLM drafter")
    return cfg, params


# ---------------------------------------------------------------------------------------------
# GGUF

_GGUF_LAYER = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo", "attn_gate": "wg",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down",
}
_MATRICES = {"wq", "wk", "wv", "wo", "wg", "w_gate", "w_up", "w_down"}


def _gguf_prefix(reader, path: str) -> str:
    """The metadata prefix of a Laguna drafter GGUF: ``"dflash-draft."`` (ik) or ``"dflash."``."""
    arch = metadata(reader, "general.architecture")
    if arch == "dflash-draft":
        if not metadata(reader, "dflash-draft.dflash.laguna", False):
            raise DFlashError(f"{path}: key dflash-draft.dflash.laguna", "missing or false", "true for a Laguna drafter")
        return "dflash-draft."
    if arch == "dflash":
        if metadata(reader, "dflash.decoder_arch") != "laguna":
            raise DFlashError(f"{path}: key dflash.decoder_arch", f"got {metadata(reader, 'dflash.decoder_arch')!r}", "laguna")
        return "dflash."
    raise DFlashError(f"{path}: key general.architecture", f"got {arch!r}", "dflash-draft or dflash (Laguna drafter)")


def _gguf_config(reader, path: str, p: str, target_cfg, dtype: str, sliding_window: int) -> DrafterConfig:
    """The drafter config from the metadata under prefix ``p`` (vocabulary and target layer count
    from ``target_cfg``); gate per head until the ``attn_gate`` width says otherwise."""
    def key(k, default=None, required=True):
        v = metadata(reader, p + k, default)
        if v is None and required:
            raise DFlashError(f"{path}: key {p}{k}", "missing", "a value")
        return v

    n = int(key("block_count"))
    if p == "dflash-draft.":
        ids = [int(i) for i in key("dflash.target_layer_ids")]
        block, mask = int(key("dflash.block_size")), int(key("dflash.mask_token_id"))
        window = int(key("attention.sliding_window", 0, required=False) or 0)
        causal = bool(key("attention.causal", True, required=False))
    else:
        ids = [int(i) - 1 for i in key("target_layers")]  # stored as layer id + 1
        block = int(key("block_size"))
        mask = metadata(reader, "tokenizer.ggml.mask_token_id")
        if mask is None:
            raise DFlashError(f"{path}: key tokenizer.ggml.mask_token_id", "missing", "the DFlash mask token id")
        mask, window, causal = int(mask), int(sliding_window), True
    return DrafterConfig(
        hidden_size=int(key("embedding_length")), intermediate_size=int(key("feed_forward_length")), num_hidden_layers=n,
        num_attention_heads=int(key("attention.head_count")), num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=int(key("attention.key_length")), vocab_size=target_cfg.vocab_size, block_size=block, mask_token_id=mask,
        target_layer_ids=tuple(ids), num_target_layers=target_cfg.num_hidden_layers, layer_causal=(causal,) * n,
        layer_window=(window,) * n, rms_norm_eps=float(f"{float(key('attention.layer_norm_rms_epsilon')):.7g}"),  # undo float32 storage
        rope=RopeConfig(theta=float(key("rope.freq_base"))), architecture=LAGUNA_DRAFTER, gate="head", dtype=str(dtype),
    )


def _gguf_params(reader, path: str, ik: bool, cfg: DrafterConfig, weights: str = "float") -> tuple[DrafterConfig, dict]:
    """``(cfg with the gate kind of the attn_gate width, float32 numpy params)``; every tensor
    checked against the config's shapes. With ``weights="quantized"`` the quantized matrices
    (``fc``, each stacked layer matrix whose layers share one type) are
    :class:`~dflash_jax.nn.quant.QuantizedWeight` leaves instead (:mod:`dflash_jax.formats.gguf_leaves`)."""
    n, K = cfg.num_hidden_layers, len(cfg.target_layer_ids)
    tensors = {t.name: t for t in reader.tensors}
    if ik:
        glob = {"fc": "dflash_fc.weight", "hidden_norm": "dflash_hidden_norm.weight", "norm": "output_norm.weight"}
        aux, mlp_norm = [f"dflash_aux_hidden_norm.{j}.weight" for j in range(K)], "post_attention_norm"
    else:
        glob = {"fc": "fc.weight", "hidden_norm": "enc.output_norm.weight", "norm": "output_norm.weight"}
        aux, mlp_norm = ["enc.aux_norm.weight"], "ffn_norm"
    gates = [f"blk.{i}.attn_gate.weight" for i in range(n)]
    missing = [t for t in aux + gates if t not in tensors]
    if missing:
        raise DFlashError(f"{path}: tensors {', '.join(missing)}",
                          "missing: a Laguna drafter needs its per-aux norms (aux_hidden_norms) and gates",
                          "the enc.aux_norm / dflash_aux_hidden_norm.* and attn_gate tensors")

    def read(name):
        if name not in tensors:
            raise DFlashError(f"{path}: tensor {name}", "missing", "every drafter tensor")
        return np.asarray(dequantize_tensor(tensors[name], f"{path}: tensor {name}"), np.float32)

    cfg = _check_gate(cfg, read(gates[0]).shape[0], f"{path}: tensor {gates[0]}")
    shapes = param_shapes(cfg)
    out = {k: read(v) for k, v in glob.items()}
    out["fc"] = out["fc"].T
    out["aux_norm"] = np.stack([read(a) for a in aux]) if ik else read(aux[0]).reshape(K, -1)
    names = dict(_GGUF_LAYER, **{mlp_norm: "mlp_norm"})
    quantized = _quantized(path, tensors, {"fc": ([(glob["fc"], None)], shapes["fc"])} | {
        ("layers", leaf): ([(f"blk.{i}.{gg}.weight", i) for i in range(n)], shapes["layers"][leaf])
        for gg, leaf in names.items() if leaf in _MATRICES}, cfg.dtype) if weights == "quantized" else {}
    out["layers"] = {leaf: quantized.get(("layers", leaf)) or np.stack([r.T if leaf in _MATRICES else r for r in
                                                                       (read(f"blk.{i}.{gg}.weight") for i in range(n))])
                     for gg, leaf in names.items()}
    if "fc" in quantized:
        out["fc"] = quantized["fc"]
    for k, v in out.items():
        if k != "layers" and tuple(v.shape) != shapes[k]:
            raise DFlashError(f"{path}: tensor {glob.get(k, aux[0])}", f"shape {v.shape}", f"{shapes[k]} for this config")
    for leaf, arr in out["layers"].items():
        if tuple(arr.shape) != shapes["layers"][leaf]:
            raise DFlashError(f"{path}: tensors blk.*.{[g for g, l in names.items() if l == leaf][0]}.weight",
                              f"stacked shape {arr.shape}", f"{shapes['layers'][leaf]} for this config")
    return cfg, out


def _quantized(path: str, tensors: dict, leaves: dict, dtype) -> dict:
    """``{leaf key: QuantizedWeight}`` of the ``{key: (parts, float shape)}`` leaves whose tensors
    share one quantized type (:func:`dflash_jax.formats.gguf_leaves.quantized_leaf`)."""
    from dflash_jax.formats import gguf_leaves

    out = {k: gguf_leaves.quantized_leaf(path, tensors, parts, shape, dtype) for k, (parts, shape) in leaves.items()}
    return {k: v for k, v in out.items() if v is not None}


def load_laguna_drafter_gguf(path: str | os.PathLike, target_cfg, dtype: str = "float32", sliding_window: int = 512,
                             weights: str = "float") -> tuple[DrafterConfig, dict]:
    """Loads a Laguna drafter GGUF in the ik ``dflash-draft`` or mainline ``dflash`` layout.

    Args:
      path: the ``.gguf`` file.
      target_cfg: the target config (vocab size and layer count are not in the drafter file).
      dtype: parameter dtype name.
      sliding_window: window for the ``dflash`` layout, which stores none (vLLM's 512).
      weights: ``"float"``, or ``"quantized"`` (``"auto"``): its quantized matrices (a Q8_0
        drafter's) stay quantized.
    Returns:
      ``(DrafterConfig, params)`` equal to what the safetensors checkpoint loads to.
    Raises:
      DFlashError: an architecture other than ``dflash-draft`` (with ``dflash.laguna`` true) or
        ``dflash`` (with ``decoder_arch`` laguna), missing keys, missing aux norms or gates
        (named), or mis-shaped tensors; the drafter must fit ``target_cfg``.
    """
    path = str(path)
    reader = open_gguf(path)
    prefix = _gguf_prefix(reader, path)
    cfg = _gguf_config(reader, path, prefix, target_cfg, dtype, sliding_window)
    check_drafter_fits(cfg, target_cfg, source=path)
    from dflash_jax.formats.gguf_leaves import check_weights

    cfg, out = _gguf_params(reader, path, prefix == "dflash-draft.", cfg, check_weights(weights))
    return cfg, jax.tree_util.tree_map(lambda a: jax.device_put(a) if quant.is_quantized(a) else jax.numpy.asarray(a.astype(dtype)),
                                       out, is_leaf=quant.is_quantized)


def param_specs(cfg: DrafterConfig) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` of every Laguna drafter parameter (module
    docstring; the draft-vocabulary leaves are added by :func:`dflash_jax.drafter.model.param_specs`)."""
    H = cfg.hidden_size
    gate = cfg.num_attention_heads * (1 if cfg.gate == "head" else cfg.head_dim)
    layer = decoder_layer(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                          qk_norm=True, gate=gate)
    return {"fc": ParamSpec((len(cfg.target_layer_ids) * H, H), ("features", "embed")),
            "aux_norm": ParamSpec((len(cfg.target_layer_ids), H), ("captures", "embed"), "norm"),
            "hidden_norm": ParamSpec((H,), ("embed",), "norm"), "norm": ParamSpec((H,), ("embed",), "norm"),
            "layers": stacked(cfg.num_hidden_layers, layer)}


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every Laguna drafter parameter (module docstring)."""
    return P.shapes(param_specs(cfg))


def fuse(params: dict, cfg: DrafterConfig, features: jnp.ndarray) -> jnp.ndarray:
    """``[B, T, K*H]`` captured features -> ``[B, T, H]`` fused context
    ``hidden_norm(fc(concat_j aux_norm_j(slice_j))))`` (vLLM ``combine_hidden_states``)."""
    b, t, _ = features.shape
    K, H = len(cfg.target_layer_ids), cfg.hidden_size
    f = rms_norm(features.astype(cfg.dtype).reshape(b, t, K, H), params["aux_norm"], cfg.rms_norm_eps)
    return rms_norm(quant.dot(f.reshape(b, t, K * H), params["fc"]), params["hidden_norm"], cfg.rms_norm_eps)


def context_kv(params: dict, cfg: DrafterConfig, features: jnp.ndarray, positions: jnp.ndarray):
    """Context keys and values of every drafter layer.

    Args:
      features: ``[B, T, K*H]`` captured target residuals (K = len(target_layer_ids)).
      positions: ``[B, T]`` int32 absolute positions.
    Returns:
      ``(k, v)`` each ``[Ld, B, T, Hkv, D]``; ``k = RoPE(k_norm(input_layernorm(c) Wk))``,
      ``v = input_layernorm(c) Wv`` (vLLM ``precompute_and_store_context_kv``).
    """
    lp = params["layers"]
    c = fuse(params, cfg, features)
    u = rms_norm(c[None], lp["attn_norm"][:, None, None, :], cfg.rms_norm_eps)
    k, v = generic.layers_dot(u, lp["wk"]), generic.layers_dot(u, lp["wv"])
    return context_heads(cfg, k, v, lp["k_norm"], positions)


forward = generic.forward
"""One draft pass over a block (:func:`dflash_jax.drafter.generic.forward`: the generic
drafter's layers with this config's softplus gate, causal block and sliding windows)."""
