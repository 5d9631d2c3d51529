"""Gemma 4 GGUF targets (llama.cpp ``general.architecture`` ``gemma4``) -> :class:`Gemma4Config` and
the params of :mod:`dflash_jax.families.gemma4.model`, one tensor at a time.

Layout facts (``gguf-py`` ``MODEL_TENSORS[GEMMA4]`` / ``TensorNameMap`` and llama.cpp's Gemma 4
converter and ``gemma4`` graph): norm weights are stored as HF holds them (no ``+1``: Gemma 4's
RMSNorm multiplies by the plain weight); matrices in torch ``[out, in]`` order, NeoX RoPE (no row
permutation). Per layer ``attn_norm``, ``attn_q``/``attn_k``/``attn_v``/``attn_output``,
``attn_q_norm``/``attn_k_norm``, ``post_attention_norm``, ``ffn_norm`` (HF
``pre_feedforward_layernorm``), ``ffn_gate``/``ffn_up``/``ffn_down``, ``post_ffw_norm`` and
``layer_output_scale [1]`` (HF ``layer_scalar``); KV-sharing layers have no ``attn_k``/``attn_v``/
``attn_k_norm``, and a full layer under ``attention_k_eq_v`` no ``attn_v``. Per-layer inputs:
``per_layer_token_embd``, ``per_layer_model_proj``, ``per_layer_proj_norm`` and per layer
``inp_gate``, ``proj``, ``post_norm``. The MoE block: ``ffn_gate_inp`` (router ``[E, H]``),
``ffn_gate_inp.scale`` (router scale ``[H]``), ``ffn_down_exps.scale`` (per-expert scale ``[E]``),
``pre_ffw_norm_2``, ``post_ffw_norm_1``, ``post_ffw_norm_2``, the fused ``ffn_gate_up_exps``
``[E, 2*Im, H]`` (gate rows first) and ``ffn_down_exps`` ``[E, H, Im]`` (numpy order).

Metadata (``gemma4.*``): ``attention.sliding_window_pattern`` (one bool per layer, true: sliding),
``attention.key_length`` / ``key_length_swa`` (full / sliding head size), ``head_count_kv`` (one
value, or one per layer), ``feed_forward_length`` (one value, or one per layer: doubled on the KV
sharing layers under ``use_double_wide_mlp``), ``rope.freq_base`` / ``freq_base_swa``,
``attention.shared_kv_layers``, ``embedding_length_per_layer_input``, ``final_logit_softcapping``,
``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``. The full layers'
proportional RoPE is the tensor ``rope_freqs.weight [D/2]``: frequency factors 1 on the rotated
pairs, then ``1e30`` (frequency 0) on the others.
"""

from __future__ import annotations

import os
from typing import Any
import numpy as np
from dflash_jax.families.gemma4.config import LAYER_TYPES, Gemma4Config
from dflash_jax.errors import DFlashError
from dflash_jax.formats.gguf_file import (
    as_f32,
    dequantize_tensor,
    embedding_vocab,
    metadata,
    open_gguf,
    read_params,
    tensor_table,
)
from dflash_jax.formats.checkpoint import numpy_dtype
from dflash_jax.formats import gguf_leaves


ARCH = "gemma4"

_GLOBAL = {"token_embd.weight": ("embed", None), "output_norm.weight": ("norm", None), "output.weight": ("lm_head", "T"),
           "per_layer_token_embd.weight": ("embed_pl", None), "per_layer_model_proj.weight": ("pl_proj", "T"),
           "per_layer_proj_norm.weight": ("pl_norm", None)}
# GGUF per-layer tensor -> (params leaf, how the numpy-order tensor becomes ours)
_LAYER = {
    "attn_norm.weight": ("attn_norm", None), "attn_q.weight": ("wq", "T"), "attn_k.weight": ("wk", "T"), "attn_v.weight": ("wv", "T"),
    "attn_output.weight": ("wo", "T"), "attn_q_norm.weight": ("q_norm", None), "attn_k_norm.weight": ("k_norm", None),
    "post_attention_norm.weight": ("post_attn_norm", None), "ffn_norm.weight": ("mlp_norm", None), "ffn_gate.weight": ("w_gate", "T"),
    "ffn_up.weight": ("w_up", "T"), "ffn_down.weight": ("w_down", "T"), "post_ffw_norm.weight": ("post_mlp_norm", None),
    "layer_output_scale.weight": ("scalar", None), "inp_gate.weight": ("pl_gate", "T"), "proj.weight": ("pl_out", "T"),
    "post_norm.weight": ("post_pl_norm", None), "ffn_gate_inp.weight": ("router", "T"), "ffn_gate_inp.scale": ("router_scale", None),
    "ffn_down_exps.scale": ("expert_scale", None), "pre_ffw_norm_2.weight": ("pre_moe_norm", None),
    "post_ffw_norm_1.weight": ("post_mlp_norm_1", None), "post_ffw_norm_2.weight": ("post_moe_norm", None),
    "ffn_down_exps.weight": ("e_down", "E"),
}
_FUSED = "ffn_gate_up_exps.weight"  # split into e_gate / e_up by _fill_fused_experts


def _int(reader, path: str, key: str, default=None, positive: bool = True) -> int:
    value = metadata(reader, f"{ARCH}.{key}", default)
    if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
        raise DFlashError(f"{path}: metadata {ARCH}.{key}", "missing" if value is None else f"got {value!r}",
                          "a positive integer" if positive else "an integer >= 0")
    return value


def _per_layer(reader, path: str, key: str, n: int) -> list[int]:
    """An integer key written as one value or one per layer (llama.cpp ``get_key_or_arr``)."""
    value = metadata(reader, f"{ARCH}.{key}")
    if isinstance(value, list):
        if len(value) != n or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in value):
            raise DFlashError(f"{path}: metadata {ARCH}.{key}", f"got {value!r}", f"{n} positive integers")
        return value
    return [_int(reader, path, key)] * n


def _by_type(values: list[int], types: list[str], path: str, key: str) -> tuple[int, int]:
    """``(sliding, full)`` of a per-layer list that must be uniform within each layer type."""
    out = []
    for t in LAYER_TYPES:
        seen = {v for v, lt in zip(values, types) if lt == t}
        if len(seen) > 1:
            raise DFlashError(f"{path}: metadata {ARCH}.{key}", f"{sorted(seen)} on {t} layers", "one value per layer type")
        out.append(seen.pop() if seen else values[0])
    return out[0], out[1]


def _layer_types(reader, path: str, n: int) -> list[str]:
    pattern = metadata(reader, f"{ARCH}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n or any(not isinstance(p, bool) for p in pattern):
        raise DFlashError(f"{path}: metadata {ARCH}.attention.sliding_window_pattern",
                          "missing" if pattern is None else f"got {pattern!r}", f"{n} bools (true: a sliding layer)")
    return ["sliding_attention" if p else "full_attention" for p in pattern]


def _ropes(reader, tensors: dict, path: str, dims: tuple[int, int]) -> tuple:
    """``(sliding, full)`` RoPE: default on sliding layers (all ``key_length_swa`` dims rotated),
    proportional on full ones from ``rope_freqs.weight`` (module docstring; default without it)."""
    scaling = metadata(reader, f"{ARCH}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise DFlashError(f"{path}: metadata {ARCH}.rope.scaling.type", f"unsupported value {scaling!r}", "none")
    for key, d in (("rope.dimension_count_swa", dims[0]), ("rope.dimension_count", dims[1])):
        if _int(reader, path, key, d) != d:
            raise DFlashError(f"{path}: metadata {ARCH}.{key}", f"{metadata(reader, f'{ARCH}.{key}')}", f"the head size {d}")
    sliding = ("default", as_f32(metadata(reader, f"{ARCH}.rope.freq_base_swa", 10000.0)), 1.0, 1.0)
    theta = as_f32(metadata(reader, f"{ARCH}.rope.freq_base", 10000.0))
    if "rope_freqs.weight" not in tensors:
        return sliding, ("default", theta, 1.0, 1.0)
    f = dequantize_tensor(tensors["rope_freqs.weight"], path).reshape(-1)
    n_rot = int(np.sum(f == 1.0))
    if f.shape != (dims[1] // 2,) or not (np.all(f[:n_rot] == 1.0) and np.all(f[n_rot:] >= 1e29)):
        raise DFlashError(f"{path}: tensor rope_freqs.weight", f"factors {f.tolist()}",
                          f"{dims[1] // 2} factors: 1 on the rotated pairs, then 1e30 (proportional RoPE)")
    return sliding, ("proportional", theta, 2 * n_rot / dims[1], 1.0)


def _mlp(reader, path: str, n: int, n_shared: int) -> tuple[int, bool]:
    """``(intermediate_size, use_double_wide_mlp)`` from ``feed_forward_length``."""
    ffn = _per_layer(reader, path, "feed_forward_length", n)
    double = ffn[-1] != ffn[0]
    if any(f != ffn[0] * (2 if double and i >= n - n_shared else 1) for i, f in enumerate(ffn)):
        raise DFlashError(f"{path}: metadata {ARCH}.feed_forward_length", f"got {ffn}",
                          "one width, doubled on the KV-sharing layers only (use_double_wide_mlp)")
    return ffn[0], double


def _k_eq_v(tensors: dict, path: str, types: list[str], n_computing: int) -> bool:
    """Whether the full layers that compute keys and values have no ``attn_v`` (``attention_k_eq_v``)."""
    full = [i for i in range(n_computing) if types[i] == "full_attention"]
    has_v = {i: f"blk.{i}.attn_v.weight" in tensors for i in full}
    if len(set(has_v.values())) > 1:
        odd = next(i for i in full if has_v[i] != has_v[full[0]])
        raise DFlashError(f"{path}: tensor blk.{odd}.attn_v.weight", "present" if has_v[odd] else "missing",
                          "every full layer with attn_v, or none (attention_k_eq_v)")
    return bool(full) and not has_v[full[0]]


def _moe(reader, tensors: dict, path: str) -> dict:
    if "blk.0.ffn_gate_inp.weight" not in tensors:
        return {}
    moe = {k: _int(reader, path, key) for k, key in (("num_experts", "expert_count"), ("top_k_experts", "expert_used_count"),
                                                       ("moe_intermediate_size", "expert_feed_forward_length"))}
    if moe["top_k_experts"] > moe["num_experts"]:
        raise DFlashError(f"{path}: metadata {ARCH}.expert_used_count", f"{moe['top_k_experts']}", f"at most expert_count={moe['num_experts']}")
    return moe


def gemma4_gguf_config(reader, path: str, dtype: str = "float32") -> tuple[Gemma4Config, dict]:
    """:class:`Gemma4Config` from a ``gemma4`` GGUF's metadata and tensor list (module docstring).

    Returns:
      ``(cfg, tensors by name)``.
    Raises:
      DFlashError: another architecture; a missing or ill-typed key; per-layer values that differ
        within a layer type; widths other than one (doubled on KV-sharing layers); a rope scaling,
        rope dimension counts other than the head sizes, or ``rope_freqs`` factors other than
        proportional RoPE's; full layers disagreeing on ``attn_v``; an embedding disagreeing with
        the tokenizer or ``vocab_size`` (file and key or tensor named).
    """
    arch = metadata(reader, "general.architecture")
    if arch != ARCH:
        raise DFlashError(f"{path}: metadata general.architecture", "missing" if arch is None else f"got {arch!r}", repr(ARCH))
    tensors = tensor_table(reader, path)
    n = _int(reader, path, "block_count")
    types = _layer_types(reader, path, n)
    n_shared = _int(reader, path, "attention.shared_kv_layers", 0, positive=False)
    dims = (_int(reader, path, "attention.key_length_swa"), _int(reader, path, "attention.key_length"))
    heads = set(_per_layer(reader, path, "attention.head_count", n))
    if len(heads) > 1:
        raise DFlashError(f"{path}: metadata {ARCH}.attention.head_count", f"per-layer values {sorted(heads)}", "one query head count")
    ffn, double = _mlp(reader, path, n, n_shared)
    ple = _int(reader, path, "embedding_length_per_layer_input", 0, positive=False)
    softcap = metadata(reader, f"{ARCH}.final_logit_softcapping")
    cfg = Gemma4Config(
        vocab_size=embedding_vocab(reader, tensors, path, f"{ARCH}.vocab_size"), hidden_size=_int(reader, path, "embedding_length"),
        intermediate_size=ffn, num_hidden_layers=n, num_attention_heads=heads.pop(), layer_types=tuple(types), head_dims=dims,
        kv_heads=_by_type(_per_layer(reader, path, "attention.head_count_kv", n), types, path, "attention.head_count_kv"),
        ropes=_ropes(reader, tensors, path, dims), sliding_window=_int(reader, path, "attention.sliding_window"),
        per_layer_input=ple, per_layer_vocab=_rows(tensors, path, "per_layer_token_embd.weight") if ple else 0,
        final_logit_softcapping=as_f32(softcap) if softcap else 0.0, num_kv_shared_layers=n_shared, use_double_wide_mlp=double,
        attention_k_eq_v=_k_eq_v(tensors, path, types, n - n_shared), rms_norm_eps=as_f32(_eps(reader, path)),
        tie_word_embeddings="output.weight" not in tensors, max_position_embeddings=int(metadata(reader, f"{ARCH}.context_length", 131072)),
        dtype=str(dtype), **_moe(reader, tensors, path),
    )
    return cfg, tensors


def _rows(tensors: dict, path: str, name: str) -> int:
    if name not in tensors or len(tensors[name].shape) != 2:
        raise DFlashError(f"{path}: tensor {name}", "missing" if name not in tensors else f"ggml shape {list(tensors[name].shape)}",
                          "2 dims [width, vocab] (embedding_length_per_layer_input > 0)")
    return int(tensors[name].shape[1])


def _eps(reader, path: str) -> float:
    eps = metadata(reader, f"{ARCH}.attention.layer_norm_rms_epsilon")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise DFlashError(f"{path}: metadata {ARCH}.attention.layer_norm_rms_epsilon", "missing" if eps is None else f"got {eps!r}",
                          "a positive number")
    return eps


def gguf_names(cfg: Gemma4Config) -> dict[str, tuple[str, str, None, str | None]]:
    """``{GGUF tensor name: (params key, leaf or "", None, conversion)}`` of every parameter but
    the fused experts (conversion ``"T"``: transpose, ``"E"``: swap each expert's two axes)."""
    from dflash_jax.families.gemma4.model import MODEL

    shapes = MODEL.param_shapes(cfg)
    names = {g: (key, "", None, conv) for g, (key, conv) in _GLOBAL.items() if key in shapes}
    for i in range(cfg.num_hidden_layers):
        for base, (leaf, conv) in _LAYER.items():
            if leaf in shapes[f"layer{i}"]:
                names[f"blk.{i}.{base}"] = (f"layer{i}", leaf, None, conv)
    return names


def _fill_fused_experts(path: str, tensors: dict, cfg: Gemma4Config, out: dict, weights: str = "float") -> None:
    """Each MoE layer's ``ffn_gate_up_exps [E, 2*Im, H]`` split into ``e_gate`` / ``e_up [E, H, Im]``
    (with ``weights="quantized"``, a quantized tensor split by its rows, still quantized)."""
    E, Im, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for i in range(cfg.num_hidden_layers if cfg.num_experts else 0):
        name = f"blk.{i}.{_FUSED}"
        if name not in tensors:
            raise DFlashError(f"{path}: tensor {name}", "missing", "the fused gate/up experts of every MoE layer")
        lp = out[f"layer{i}"]
        qw = gguf_leaves.quantized_leaf(path, tensors, [(name, None)], (E, H, 2 * Im), cfg.dtype) if weights == "quantized" else None
        if qw is not None:
            lp["e_gate"] = qw.replace(fields={k: a[:, :Im] for k, a in qw.fields.items()})
            lp["e_up"] = qw.replace(fields={k: a[:, Im:] for k, a in qw.fields.items()})
            continue
        x = dequantize_tensor(tensors[name], path)
        if x.shape != (E, 2 * Im, H):
            raise DFlashError(f"{path}: tensor {name}", f"ggml shape {list(reversed(x.shape))}", f"{[H, 2 * Im, E]} for this config")
        lp["e_gate"][...], lp["e_up"][...] = np.swapaxes(x[:, :Im], 1, 2), np.swapaxes(x[:, Im:], 1, 2)


def load_gemma4_gguf_target(path: str | os.PathLike, dtype: Any = "float32", *, as_numpy: bool = False,
                            weights: str = "float") -> tuple[Gemma4Config, dict]:
    """Loads a ``gemma4`` GGUF as ``(Gemma4Config, params)``, one tensor at a time (no float32 cache).

    Args:
      path: the ``.gguf`` file (any tensor type :func:`dflash_jax.formats.gguf_file.dequantize_tensor` reads).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); weights are
        dequantized to float32, then cast.
      as_numpy: numpy leaves instead of jax arrays.
      weights: ``"float"``, or ``"quantized"`` (``"auto"``): quantized matrices and tables stay
        quantized (:func:`dflash_jax.formats.gguf_file.read_params`; every layer is its own leaf).
    Returns:
      The config and the params of :mod:`dflash_jax.families.gemma4.model`, equal to
      :func:`dflash_jax.families.gemma4.safetensors.load_gemma4_target` on the source safetensors.
    Raises:
      DFlashError: as :func:`gemma4_gguf_config`; a missing, unexpected or mis-shaped tensor
        (file and tensor named).
    Source: llama.cpp's Gemma 4 converter (tensor names, metadata keys) and ``gemma4`` graph.
    """
    import jax

    from dflash_jax.families.gemma4.model import MODEL

    path, target = str(path), numpy_dtype(dtype)
    weights = gguf_leaves.check_weights(weights)
    reader = open_gguf(path)
    cfg, tensors = gemma4_gguf_config(reader, path, target.name)
    fused = cfg.num_experts > 0  # without experts a fused tensor stays in and is refused as unexpected
    plain = {k: t for k, t in tensors.items() if k != "rope_freqs.weight" and not (fused and k.endswith(_FUSED))}
    out = read_params(path, plain, gguf_names(cfg), MODEL.param_shapes(cfg), target, f"a {cfg.num_hidden_layers}-layer gemma4 model",
                      weights=weights)
    _fill_fused_experts(path, tensors, cfg, out, weights)
    return cfg, (out if as_numpy else jax.device_put(out))
