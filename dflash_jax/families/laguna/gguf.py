"""Laguna target GGUF (``general.architecture = "laguna"``) -> :class:`LagunaConfig` and the
params of :mod:`dflash_jax.families.laguna.model`, equal to what :func:`dflash_jax.families.laguna.safetensors.load_laguna_target`
reads from the safetensors checkpoint the GGUF was converted from.

Layout facts (``docs/specs/laguna.md`` 4.2; llama.cpp ``conversion/laguna.py`` and
``src/models/laguna.cpp``, ik_llama.cpp ``LagunaModel``):

* Keys ``laguna.*``: ``block_count``, ``context_length``, ``embedding_length``,
  ``feed_forward_length`` (dense layers), ``attention.head_count`` (a per-layer array, or one
  value), ``attention.head_count_kv``, ``attention.key_length`` (``value_length`` equal),
  ``attention.layer_norm_rms_epsilon``, ``attention.sliding_window`` (absent or 0: every layer
  full attention, M.1), ``attention.sliding_window_pattern`` (a period ``p``, default 4, full
  attention at ``i % p == 0`` as llama.cpp's ``set_swa_pattern(p, dense_first=true)``; or a
  per-layer bool array, true = sliding), ``rope.dimension_count`` (full layers' rotated dims,
  already ``head_dim * partial``), ``rope.dimension_count_swa``, ``rope.freq_base``,
  ``rope.freq_base_swa`` (default ``freq_base``, as llama.cpp), ``rope.scaling.{type, factor,
  original_context_length, yarn_beta_fast, yarn_beta_slow, yarn_attn_factor}`` (YaRN of the full
  layers only; ``attn_factor`` read when ``yarn_attn_factor`` is absent; neither means the
  config had no ``attention_factor``), ``expert_count``, ``expert_used_count``,
  ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``,
  ``expert_weights_scale`` (routed scaling), ``expert_weights_norm`` (must be true),
  ``expert_gating_func`` (must be sigmoid), ``leading_dense_block_count`` (layers before it are
  dense, the rest MoE).
* Tensors: ``token_embd``, ``output_norm``, ``output`` (absent: tied), per layer
  ``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, attn_gate,
  ffn_norm}`` plus dense ``ffn_{gate,up,down}`` or MoE ``ffn_gate_inp``, ``exp_probs_b.bias``
  (float32), ``ffn_{gate,up,down}_exps`` (experts stacked: numpy ``[E, Im, H]`` /
  ``[E, H, Im]``), ``ffn_{gate,up,down}_shexp``.
* Laguna uses NeoX rope in llama.cpp, so the converter does **not** permute q/k rows (unlike
  ``llama``): nothing is un-permuted here.
* The gate kind comes from each ``attn_gate`` width (``nh``: per head, ``nh * head_dim``: per
  element), as llama.cpp does; the converter already checked it against ``gating``.

Not representable in a GGUF (so taken as the transformers defaults): ``moe_router_logit_softcapping``
(0), ``moe_router_score_func`` (sigmoid), YaRN ``truncate`` (true), ``mscale`` /
``mscale_all_dim`` (none). Floats are stored as float32 and read back as the shortest decimal
that round-trips (``1e-06``, ``2.5``), so a config value that is not float32-exact (e.g. an
``attention_factor`` of 1.3465735902799727) comes back rounded to float32.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
import numpy as np
from dflash_jax.families.hf_config import RopeConfig
from dflash_jax.families.laguna.config import LagunaConfig
from dflash_jax.errors import DFlashError
from dflash_jax.formats import gguf_leaves
from dflash_jax.formats.gguf_file import as_f32, dequantize_tensor, embedding_vocab, metadata, open_gguf, tensor_table
from dflash_jax.formats.checkpoint import numpy_dtype
from dflash_jax.families.laguna.safetensors import resolve_gating
from dflash_jax.families.laguna import model as laguna


ARCH = "laguna"

# per-layer GGUF tensor -> (params leaf, how the numpy-order array becomes the leaf)
_ATTN = {
    "attn_norm.weight": ("attn_norm", None),
    "ffn_norm.weight": ("mlp_norm", None),
    "attn_q.weight": ("wq", "T"),
    "attn_k.weight": ("wk", "T"),
    "attn_v.weight": ("wv", "T"),
    "attn_output.weight": ("wo", "T"),
    "attn_gate.weight": ("wg", "T"),
    "attn_q_norm.weight": ("q_norm", None),
    "attn_k_norm.weight": ("k_norm", None),
}
_DENSE = {"ffn_gate.weight": ("w_gate", "T"), "ffn_up.weight": ("w_up", "T"), "ffn_down.weight": ("w_down", "T")}
_SPARSE = {
    "ffn_gate_inp.weight": ("router", "T"),
    "exp_probs_b.bias": ("router_bias", None),
    "ffn_gate_exps.weight": ("e_gate", "swap"),
    "ffn_up_exps.weight": ("e_up", "swap"),
    "ffn_down_exps.weight": ("e_down", "swap"),
    "ffn_gate_shexp.weight": ("s_gate", "T"),
    "ffn_up_shexp.weight": ("s_up", "T"),
    "ffn_down_shexp.weight": ("s_down", "T"),
}


def _stored(shape: tuple, how) -> tuple:
    """Numpy-order shape of the GGUF tensor holding a leaf slice of ``shape``."""
    if how == "T":
        return tuple(reversed(shape))
    if how == "swap":
        return (shape[0], shape[2], shape[1])
    return tuple(shape)


def _to_leaf(x: np.ndarray, how) -> np.ndarray:
    if how == "T":
        return x.T
    if how == "swap":
        return x.swapaxes(1, 2)
    return x


class _Meta:
    """Typed access to ``laguna.*`` metadata; errors name the file and the key."""

    def __init__(self, reader, path: str):
        self.reader, self.path = reader, path

    def where(self, key: str) -> str:
        return f"{self.path}: metadata {ARCH}.{key}"

    def raw(self, key: str, default=None):
        return metadata(self.reader, f"{ARCH}.{key}", default)

    def int(self, key: str, default: Any = dataclasses.MISSING, positive: bool = True) -> int:
        v = self.raw(key)
        if v is None:
            if default is dataclasses.MISSING:
                raise DFlashError(self.where(key), "missing", "an integer")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or (positive and v <= 0):
            raise DFlashError(self.where(key), f"got {v!r}", "a positive integer" if positive else "an integer")
        return int(v)

    def float(self, key: str, default: Any = dataclasses.MISSING) -> float:
        v = self.raw(key)
        if v is None:
            if default is dataclasses.MISSING:
                raise DFlashError(self.where(key), "missing", "a number")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise DFlashError(self.where(key), f"got {v!r}", "a number")
        return as_f32(v)

    def per_layer_int(self, key: str, n: int) -> tuple:
        v = self.raw(key)
        if v is None:
            raise DFlashError(self.where(key), "missing", f"an integer or {n} integers")
        vals = v if isinstance(v, list) else [v] * n
        if len(vals) != n or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in vals):
            raise DFlashError(self.where(key), f"got {v!r}", f"a positive integer or {n} of them (block_count)")
        return tuple(int(x) for x in vals)


def _layer_types(m: _Meta, n: int) -> tuple[tuple, int]:
    window = m.int("attention.sliding_window", 0, positive=False)
    if window <= 0:
        return ("full_attention",) * n, 0
    pat = m.raw("attention.sliding_window_pattern", 4)
    if isinstance(pat, list):
        if len(pat) != n or not all(isinstance(x, bool) for x in pat):
            raise DFlashError(m.where("attention.sliding_window_pattern"), f"got {pat!r}", f"a period or {n} booleans (true = sliding)")
        sliding = list(pat)
    elif isinstance(pat, int) and not isinstance(pat, bool) and pat >= 0:
        sliding = [pat == 0 or i % pat != 0 for i in range(n)]  # llama.cpp set_swa_pattern(p, dense_first=true)
    else:
        raise DFlashError(m.where("attention.sliding_window_pattern"), f"got {pat!r}", "a non-negative period or a boolean per layer")
    return tuple("sliding_attention" if s else "full_attention" for s in sliding), int(window)


def _partial(m: _Meta, key: str, head_dim: int, default: int) -> float:
    rot = m.int(key, default)
    if rot % 2 or rot > head_dim:
        raise DFlashError(m.where(key), f"got {rot}", f"an even number <= head_dim {head_dim}")
    return rot / head_dim


def _ropes(m: _Meta, head_dim: int, has_sliding: bool) -> tuple[RopeConfig, RopeConfig]:
    theta = m.float("rope.freq_base")
    partial = _partial(m, "rope.dimension_count", head_dim, dataclasses.MISSING)
    kind = m.raw("rope.scaling.type", "none")
    if kind in (None, "none"):
        full = RopeConfig(theta=theta, partial=partial)
    elif kind == "yarn":
        attn = m.raw("rope.scaling.yarn_attn_factor")
        key = "rope.scaling.yarn_attn_factor"
        if attn is None:
            attn, key = m.raw("rope.scaling.attn_factor"), "rope.scaling.attn_factor"
        full = RopeConfig(
            theta=theta, partial=partial, kind="yarn", factor=m.float("rope.scaling.factor"),
            original_max_position_embeddings=m.int("rope.scaling.original_context_length"),
            beta_fast=m.float("rope.scaling.yarn_beta_fast", 32.0), beta_slow=m.float("rope.scaling.yarn_beta_slow", 1.0),
            attention_factor=None if attn is None else m.float(key),
        )
    else:
        raise DFlashError(m.where("rope.scaling.type"), f"unsupported value {kind!r}", "none or yarn")
    if m.raw("rope.freq_base_swa") is None and not has_sliding:
        return full, full
    sliding = RopeConfig(theta=m.float("rope.freq_base_swa", theta), partial=_partial(m, "rope.dimension_count_swa", head_dim, head_dim))
    return full, sliding


def _moe_sizes(m: _Meta, n: int) -> dict:
    """``LagunaConfig`` MoE fields (``leading_dense_block_count`` dense layers, then sparse ones);
    refuses expert options Laguna does not use."""
    lead = m.int("leading_dense_block_count", positive=False)
    if lead > n:
        raise DFlashError(m.where("leading_dense_block_count"), f"got {lead}", f"at most block_count = {n}")
    out = dict(mlp_layer_types=("dense",) * lead + ("sparse",) * (n - lead))
    if lead == n:
        return out
    if m.raw("expert_weights_norm") is not None and m.raw("expert_weights_norm") is not True:
        raise DFlashError(m.where("expert_weights_norm"), f"got {m.raw('expert_weights_norm')!r}", "true (Laguna renormalises the top-k weights)")
    func = m.raw("expert_gating_func")
    if func is not None and func != 2:
        raise DFlashError(m.where("expert_gating_func"), f"got {func!r}", "2 (sigmoid)")
    shared = m.raw("expert_shared_count")
    if shared is not None and shared != 1:
        raise DFlashError(m.where("expert_shared_count"), f"got {shared!r}", "1 (one always-on shared expert)")
    return dict(out, num_experts=m.int("expert_count"), num_experts_per_tok=m.int("expert_used_count"),
                moe_intermediate_size=m.int("expert_feed_forward_length"),
                shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length"),
                routed_scaling_factor=m.float("expert_weights_scale"))


def _gate_widths(tensors: dict, path: str, n: int, hidden: int) -> dict[int, int]:
    """``{layer: attn_gate width}`` (ggml ``[H, width]``); every layer must have its gate."""
    widths = {}
    for i in range(n):
        name = f"blk.{i}.attn_gate.weight"
        if name not in tensors:
            raise DFlashError(f"{path}: tensor {name}", "missing", "the softplus output gate of every layer")
        shape = [int(x) for x in tensors[name].shape]
        if len(shape) != 2:
            raise DFlashError(f"{path}: tensor {name}", f"ggml shape {shape}", f"[{hidden}, heads or heads*head_dim]")
        widths[i] = shape[1]
    return widths


def laguna_gguf_config(reader, path: str, dtype: str = "float32") -> tuple[LagunaConfig, dict]:
    """:class:`LagunaConfig` from a ``laguna`` GGUF's metadata and tensor list.

    Returns:
      ``(cfg, tensors by name)``; ``cfg.gate_per_head`` from the ``attn_gate`` widths.
    Raises:
      DFlashError: wrong architecture, a missing or ill-typed key, an unsupported rope scaling /
        gating function / unnormalised expert weights, a missing or 2-D-violating
        ``token_embd``, a tokenizer or ``vocab_size`` disagreeing with the embedding, or an
        ``attn_gate`` of neither width. Messages name the file and the key or tensor.
    """
    arch = metadata(reader, "general.architecture")
    if arch != ARCH:
        raise DFlashError(f"{path}: metadata general.architecture", f"got {arch!r}", f"{ARCH!r}")
    m = _Meta(reader, path)
    tensors = tensor_table(reader, path)
    n = m.int("block_count")
    head_dim = m.int("attention.key_length")
    if m.raw("attention.value_length") not in (None, head_dim):
        raise DFlashError(m.where("attention.value_length"), f"got {m.raw('attention.value_length')!r}", f"{head_dim} (key_length)")
    kv = m.per_layer_int("attention.head_count_kv", n)
    if len(set(kv)) != 1:
        raise DFlashError(m.where("attention.head_count_kv"), f"per-layer values {list(kv)}", "one value for every layer")
    layer_types, window = _layer_types(m, n)
    moe = _moe_sizes(m, n)
    vocab = embedding_vocab(reader, tensors, path, f"{ARCH}.vocab_size")
    rope_full, rope_sliding = _ropes(m, head_dim, "sliding_attention" in layer_types)
    cfg = LagunaConfig(
        vocab_size=vocab,
        hidden_size=m.int("embedding_length"),
        intermediate_size=m.int("feed_forward_length"),
        num_hidden_layers=n,
        heads_per_layer=m.per_layer_int("attention.head_count", n),
        num_key_value_heads=kv[0],
        head_dim=head_dim,
        layer_types=layer_types,
        gate_per_head=(True,) * n,
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        sliding_window=window,
        rms_norm_eps=m.float("attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=m.int("context_length"),
        dtype=str(dtype),
        **moe,
    )
    widths = _gate_widths(tensors, path, n, cfg.hidden_size)
    cfg = resolve_gating(cfg, widths, lambda i: f"{path}: tensor blk.{i}.attn_gate.weight")
    # The widths fix the gate kind (the converter checked them against ``gating``).
    return dataclasses.replace(cfg, gating_explicit=True), tensors


def gguf_names(cfg: LagunaConfig) -> dict[str, tuple[tuple[str, ...], int | None, Any]]:
    """``{GGUF tensor name: (params path, repetition index or None, transform)}`` for ``cfg``."""
    names: dict = {"token_embd.weight": (("embed",), None, None), "output_norm.weight": (("norm",), None, None)}
    if not cfg.tie_word_embeddings:
        names["output.weight"] = (("lm_head",), None, "T")
    for i in range(cfg.num_hidden_layers):
        key, r = laguna.layer_slot(cfg, i)
        per = dict(_ATTN, **(_DENSE if cfg.mlp_layer_types[i] == "dense" else _SPARSE))
        for base, (leaf, how) in per.items():
            names[f"blk.{i}.{base}"] = ((key, leaf), r, how)
    return names


def load_laguna_gguf_target(path: str | os.PathLike, dtype: Any = "float32", *, as_numpy: bool = False,
                            weights: str = "float") -> tuple[LagunaConfig, dict]:
    """Loads a Laguna target GGUF as ``(LagunaConfig, params)``, one tensor at a time.

    Args:
      path: the ``.gguf`` file (any tensor type :func:`dflash_jax.formats.gguf_file.dequantize_tensor`
        reads: F32, F16, BF16, Q*_0, Q*_1, K-quants).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); weights are
        dequantized to float32 and cast; ``router_bias`` (``exp_probs_b``) stays float32.
      as_numpy: numpy leaves instead of jax arrays.
      weights: ``"float"``, or ``"quantized"`` (``"auto"``): quantized matrices, experts and the
        embedding stay quantized (:mod:`dflash_jax.formats.gguf_leaves`), layers stacked by their
        formats (``cfg.weight_formats``); each leaf goes to the device as it is read.
    Returns:
      The config (module docstring) and the params of :mod:`dflash_jax.families.laguna.model`, equal to
      :func:`dflash_jax.families.laguna.safetensors.load_laguna_target` on the source safetensors.
    Raises:
      DFlashError: as :func:`laguna_gguf_config`; a missing, unexpected or mis-shaped tensor, or
        an unreadable quantization (file and tensor named).
    """
    import jax

    path = str(path)
    target = numpy_dtype(dtype)
    weights = gguf_leaves.check_weights(weights)
    reader = open_gguf(path)
    cfg, tensors = laguna_gguf_config(reader, path, target.name)
    if weights == "quantized":
        cfg = dataclasses.replace(cfg, weight_formats=gguf_leaves.layer_formats(tensors, cfg.num_hidden_layers))
    names = gguf_names(cfg)
    shapes = laguna.MODEL.param_shapes(cfg)
    for name in names:
        if name not in tensors:
            raise DFlashError(f"{path}: tensor {name}", "missing", f"every tensor of this {cfg.num_hidden_layers}-layer Laguna model")
    for name in tensors:
        if name not in names:
            raise DFlashError(f"{path}: tensor {name}", "unexpected", "only the tensors of a Laguna model of this config")
    by_leaf: dict = {}
    for name, (leaf_path, r, how) in names.items():
        full = shapes[leaf_path[0]] if len(leaf_path) == 1 else shapes[leaf_path[0]][leaf_path[1]]
        want = _stored(tuple(full if r is None else full[1:]), how)
        got = tuple(int(d) for d in reversed([int(x) for x in tensors[name].shape]))
        if got != want:
            raise DFlashError(f"{path}: tensor {name}", f"ggml shape {list(reversed(got))}", f"{list(reversed(want))} for this config")
        by_leaf.setdefault(leaf_path, []).append((name, r, how))

    def leaf(leaf_path):
        full = shapes[leaf_path[0]] if len(leaf_path) == 1 else shapes[leaf_path[0]][leaf_path[1]]
        dt = np.dtype(np.float32) if leaf_path[-1] == "router_bias" else target
        parts, table = by_leaf[leaf_path], leaf_path[-1] in gguf_leaves.TABLES
        if weights == "quantized" and ({how for _, _, how in parts} <= set(gguf_leaves.MATRIX_CONVERSIONS) or table):
            qw = gguf_leaves.quantized_leaf(path, tensors, [(name, r) for name, r, _ in parts], full, target, table)
            if qw is not None:
                return qw if as_numpy else jax.device_put(qw)
        out = np.empty(full, dt)
        for name, r, how in by_leaf[leaf_path]:
            x = _to_leaf(dequantize_tensor(tensors[name], path), how)
            if r is None:
                out[...] = x.astype(dt)
            else:
                out[r] = x.astype(dt)
        return out if as_numpy else jax.device_put(out)

    params: dict = {}
    for key, value in shapes.items():
        params[key] = {n: leaf((key, n)) for n in value} if isinstance(value, dict) else leaf((key,))
    return cfg, params
