"""Qwen3.5 hybrid GGUF targets (llama.cpp ``general.architecture`` ``qwen35``, ``qwen35moe``,
``qwen3next``) -> :class:`~dflash_jax.families.qwen3_5.config.Qwen3_5Config` and the params of
:mod:`dflash_jax.families.qwen3_5.model`, one tensor at a time.

Layout facts (llama.cpp ``convert_hf_to_gguf.py`` ``Qwen3NextModel``, ``_LinearAttentionVReorderBase``,
``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``, and ``gguf-py`` ``MODEL_TENSORS``; numpy order):

* metadata: ``{arch}.ssm.conv_kernel`` (K), ``ssm.state_size`` (dk), ``ssm.group_count`` (Hk),
  ``ssm.time_step_rank`` (Hv), ``ssm.inner_size`` (Hv dv), ``full_attention_interval`` (every
  n-th layer full attention, default 4), ``rope.dimension_count`` (the rotated part of
  ``attention.key_length``); the MoE ``expert_count``, ``expert_used_count``,
  ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``. ``qwen35moe`` has no
  ``feed_forward_length`` (no dense MLP). ``rope.dimension_sections`` (multimodal RoPE) is
  ignored: for text the three position rows are equal. The last ``{arch}.nextn_predict_layers``
  blocks (the multi-token-prediction head newer converters append) are skipped: DFlash does not
  use them.
* every RMSNorm weight but ``ssm_norm`` is stored as ``1 + w`` (what our params hold);
  ``ssm_a`` holds ``-exp(A_log)``; ``ssm_dt.bias`` is ``dt_bias``; ``ssm_conv1d.weight`` ``[C, K]``.
* linear layers: ``attn_qkv`` ``[2 Hk dk + Hv dv, H]`` (q, k, v rows), ``attn_gate`` (z),
  ``ssm_beta`` / ``ssm_alpha`` (b / a; ``qwen3next``: ``ssm_ba`` grouped per key head, ``r`` b rows
  then ``r`` a rows, ``r = Hv / Hk``), ``ssm_out``. For ``qwen35`` / ``qwen35moe`` with ``Hk != Hv``
  the value heads are stored *tiled* (``[v0 of every key head, v1 of every key head, ...]``)
  instead of transformers' grouped order along every value-head axis (the v rows of ``attn_qkv``
  and of the conv, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, ``ssm_a``, ``ssm_dt``, the columns
  of ``ssm_out``): :func:`_untile` restores the grouped order our repeat of q/k assumes.
* full layers: ``attn_q`` ``[Hq 2D, H]`` as transformers' ``q_proj`` (per head D query rows, D gate
  rows), ``attn_k`` / ``attn_v`` / ``attn_output``, ``attn_q_norm`` / ``attn_k_norm``; Qwen's NeoX
  RoPE, so no row permutation.
* MLP: ``post_attention_norm``; ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` (``qwen35``), or
  ``ffn_gate_inp`` ``[E, H]``, ``ffn_{gate,up}_exps`` ``[E, Im, H]``, ``ffn_down_exps`` ``[E, H, Im]``,
  ``ffn_{gate,up,down}_shexp`` and ``ffn_gate_inp_shexp`` ``[1, H]``. llama.cpp renormalises the
  top-k weights of both MoE architectures; a ``qwen3next`` file saying otherwise is refused.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable
import numpy as np
from dflash_jax.families.qwen3_5.config import Qwen3_5Config
from dflash_jax.errors import DFlashError
from dflash_jax.families.dense.gguf import arch_config, rope_config
from dflash_jax.formats.gguf_file import dequantize_tensor, embedding_vocab, empty_params, metadata, open_gguf, tensor_table
from dflash_jax.formats.checkpoint import numpy_dtype


ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}  # GGUF -> Qwen3_5Config.variant

_T = np.transpose
_SHARED = {"attn_norm.weight": ("attn_norm", None), "post_attention_norm.weight": ("mlp_norm", None)}
_DENSE = {"ffn_gate.weight": ("w_gate", _T), "ffn_up.weight": ("w_up", _T), "ffn_down.weight": ("w_down", _T)}
_MOE = {"ffn_gate_inp.weight": ("router", _T), "ffn_gate_shexp.weight": ("s_gate", _T), "ffn_up_shexp.weight": ("s_up", _T),
        "ffn_down_shexp.weight": ("s_down", _T), "ffn_gate_inp_shexp.weight": ("s_router", _T)}
_EXPERTS = {"ffn_gate_exps.weight": "e_gate", "ffn_up_exps.weight": "e_up", "ffn_down_exps.weight": "e_down"}
_FULL = {"attn_k.weight": ("wk", _T), "attn_v.weight": ("wv", _T), "attn_output.weight": ("wo", _T),
         "attn_q_norm.weight": ("q_norm", None), "attn_k_norm.weight": ("k_norm", None)}


def _int(reader, path: str, key: str, default=None) -> int:
    value = metadata(reader, key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise DFlashError(f"{path}: metadata {key}", "missing" if value is None else f"got {value!r}", "a positive integer")
    return value


def _block(name: str) -> int:
    """The block index of a ``blk.{i}.`` tensor name, -1 for the others."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m[1]) if m else -1


def _moe_fields(reader, path: str, arch: str) -> dict:
    if metadata(reader, f"{arch}.expert_weights_norm", True) is not True:
        raise DFlashError(f"{path}: metadata {arch}.expert_weights_norm", "false", f"true (llama.cpp's {arch} renormalises)")
    return dict(num_experts=_int(reader, path, f"{arch}.expert_count"), num_experts_per_tok=_int(reader, path, f"{arch}.expert_used_count"),
                moe_intermediate_size=_int(reader, path, f"{arch}.expert_feed_forward_length"),
                shared_expert_intermediate_size=_int(reader, path, f"{arch}.expert_shared_feed_forward_length"), norm_topk_prob=True)


def qwen3_5_gguf_config(reader, path: str, dtype: str = "float32") -> tuple[Qwen3_5Config, dict]:
    """:class:`Qwen3_5Config` from a ``qwen35`` / ``qwen35moe`` / ``qwen3next`` GGUF's metadata and
    tensor list.

    Returns:
      ``(cfg, tensors by name)`` (those of the MTP blocks left out); layer types from
      ``full_attention_interval`` (llama.cpp's rule).
    Raises:
      DFlashError: another architecture; a missing or ill-typed key, or sizes that disagree
        (``ssm.inner_size`` not a multiple of ``ssm.time_step_rank``, ``ssm.group_count`` not
        dividing it, ``rope.dimension_count`` above ``attention.key_length``,
        ``nextn_predict_layers`` not below ``block_count``); unnormalised
        expert weights; an embedding disagreeing with the tokenizer or ``vocab_size`` (file and
        key or tensor named).
    """
    arch, meta = arch_config(reader, path, tuple(ARCHS), need_ffn=False)
    nextn = metadata(reader, f"{arch}.nextn_predict_layers", 0)
    if not isinstance(nextn, int) or isinstance(nextn, bool) or not 0 <= nextn < meta["layers"]:
        raise DFlashError(f"{path}: metadata {arch}.nextn_predict_layers", f"got {nextn!r}", f"0 to block_count - 1 = {meta['layers'] - 1}")
    n = meta["layers"] - nextn
    variant = ARCHS[arch]
    tensors = {k: t for k, t in tensor_table(reader, path).items() if _block(k) < n}
    ssm = {k: _int(reader, path, f"{arch}.ssm.{k}") for k in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")}
    if ssm["inner_size"] % ssm["time_step_rank"]:
        raise DFlashError(f"{path}: metadata {arch}.ssm.inner_size", f"{ssm['inner_size']} is not a multiple of ssm.time_step_rank="
                          f"{ssm['time_step_rank']}", "value heads x value head size")
    if ssm["time_step_rank"] % ssm["group_count"]:
        raise DFlashError(f"{path}: metadata {arch}.ssm.group_count", f"{ssm['group_count']} does not divide ssm.time_step_rank="
                          f"{ssm['time_step_rank']}", "a divisor of the value heads")
    if not 0 < meta["rot_dim"] <= meta["head_dim"]:
        raise DFlashError(f"{path}: metadata {arch}.rope.dimension_count", f"got {meta['rot_dim']}",
                          f"1 to attention.key_length={meta['head_dim']}")
    interval = _int(reader, path, f"{arch}.full_attention_interval", 4)
    moe = _moe_fields(reader, path, arch) if variant != "qwen3_5" else {}
    if meta["ffn"] is None and not moe:
        raise DFlashError(f"{path}: metadata {arch}.feed_forward_length", "missing", "a positive integer")
    cfg = Qwen3_5Config(
        vocab_size=embedding_vocab(reader, tensors, path, f"{arch}.vocab_size"), hidden_size=meta["hidden"],
        intermediate_size=meta["ffn"] or moe["moe_intermediate_size"], num_hidden_layers=n,
        num_attention_heads=meta["heads"], num_key_value_heads=meta["kv_heads"], head_dim=meta["head_dim"],
        layer_types=tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)),
        linear_conv_kernel_dim=ssm["conv_kernel"], linear_key_head_dim=ssm["state_size"], linear_num_key_heads=ssm["group_count"],
        linear_num_value_heads=ssm["time_step_rank"], linear_value_head_dim=ssm["inner_size"] // ssm["time_step_rank"],
        rms_norm_eps=meta["eps"], rope=rope_config(meta, None, path), tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=meta["ctx"], variant=variant, dtype=str(dtype), **moe,
    )
    return cfg, tensors


def _untile(cfg: Qwen3_5Config, axis: int, d: int) -> Callable[[np.ndarray], np.ndarray]:
    """Value heads (``d`` wide) along ``axis`` from llama.cpp's tiled order back to the grouped one
    (identity for ``qwen3next`` or ``Hk == Hv``; module docstring)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if cfg.variant == "qwen3_next" or hk == hv:
        return lambda x: x

    def f(x):
        s = x.shape
        return np.swapaxes(x.reshape(s[:axis] + (hv // hk, hk, d) + s[axis + 1:]), axis, axis + 1).reshape(s)

    return f


def _linear_plan(cfg: Qwen3_5Config) -> dict:
    """``{per-layer GGUF name: (stored numpy shape, [(leaf, fn)])}`` of a linear layer."""
    H, K, hk, hv = cfg.hidden_size, cfg.linear_conv_kernel_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dv, kd, vd, r = cfg.linear_value_head_dim, hk * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim, hv // hk
    v_rows, heads = _untile(cfg, 0, dv), _untile(cfg, 0, 1)

    def a_log(x):
        if np.any(x >= 0):
            raise DFlashError("ssm_a", "non-negative entries", "-exp(A_log) < 0, as convert_hf_to_gguf writes it")
        return np.log(-heads(x))

    plan = {
        "attn_qkv.weight": ((2 * kd + vd, H), [("wq", lambda x: x[:kd].T), ("wk", lambda x: x[kd:2 * kd].T),
                                                ("wv", lambda x: v_rows(x[2 * kd:]).T)]),
        "ssm_conv1d.weight": ((2 * kd + vd, K), [("conv_q", lambda x: x[:kd].T), ("conv_k", lambda x: x[kd:2 * kd].T),
                                                  ("conv_v", lambda x: v_rows(x[2 * kd:]).T)]),
        "attn_gate.weight": ((vd, H), [("wz", lambda x: v_rows(x).T)]),
        "ssm_a": ((hv,), [("a_log", a_log)]), "ssm_dt.bias": ((hv,), [("dt_bias", heads)]),
        "ssm_norm.weight": ((dv,), [("gnorm", None)]), "ssm_out.weight": ((H, vd), [("wo", lambda x: _untile(cfg, 1, dv)(x).T)]),
    }
    if cfg.variant == "qwen3_next":
        plan["ssm_ba.weight"] = ((hk * 2 * r, H), [("wb", lambda x: x.reshape(hk, 2 * r, H)[:, :r].reshape(hv, H).T),
                                                   ("wa", lambda x: x.reshape(hk, 2 * r, H)[:, r:].reshape(hv, H).T)])
    else:
        plan.update({"ssm_beta.weight": ((hv, H), [("wb", lambda x: heads(x).T)]), "ssm_alpha.weight": ((hv, H), [("wa", lambda x: heads(x).T)])})
    return plan


def gguf_plan(cfg: Qwen3_5Config) -> dict[str, tuple[tuple, list]]:
    """``{GGUF tensor name: (stored numpy shape, [(params key, leaf or "", layer row or None, fn)])}``:
    ``fn`` turns the stored tensor into the leaf (row) (``None``: as stored; it may raise
    DFlashError for bad values)."""
    from dflash_jax.families.qwen3_5.model import MODEL

    shapes = MODEL.param_shapes(cfg)
    plan = {"token_embd.weight": (shapes["embed"], [("embed", "", None, None)]), "output_norm.weight": (shapes["norm"], [("norm", "", None, None)])}
    if not cfg.tie_word_embeddings:
        plan["output.weight"] = (shapes["lm_head"][::-1], [("lm_head", "", None, _T)])
    nh, D = cfg.num_attention_heads, cfg.head_dim
    halves = [("wq", lambda x: x.reshape(nh, 2, D, -1)[:, 0].reshape(nh * D, -1).T), ("wg", lambda x: x.reshape(nh, 2, D, -1)[:, 1].reshape(nh * D, -1).T)]
    linear = _linear_plan(cfg)
    for key, layers in (("linear", cfg.linear_layers), ("full", cfg.full_layers)):
        own = shapes[key]
        for j, i in enumerate(layers):
            simple = dict(_SHARED, **(_MOE if cfg.sparse else _DENSE), **({} if key == "linear" else _FULL))
            for base, (leaf, fn) in simple.items():
                plan[f"blk.{i}.{base}"] = (own[leaf][1:] if fn is None else own[leaf][:0:-1], [(key, leaf, j, fn)])
            for base, leaf in (_EXPERTS if cfg.sparse else {}).items():
                e, a, b = own[leaf][1:]
                plan[f"blk.{i}.{base}"] = ((e, b, a), [(key, leaf, j, lambda x: np.swapaxes(x, 1, 2))])
            extra = linear if key == "linear" else {"attn_q.weight": ((2 * nh * D, cfg.hidden_size), halves)}
            for base, (stored, parts) in extra.items():
                plan[f"blk.{i}.{base}"] = (stored, [(key, leaf, j, fn) for leaf, fn in parts])
    return plan


def _rows_of(fn, stored: tuple):
    """The stored ``[out, in]`` rows ``fn`` picks, in order, when ``fn`` is a row selection then a
    transpose with the inputs in their order (how the plan makes most matrix leaves); ``None``
    otherwise (``ssm_out``'s inputs are reordered: that leaf is read as float). Found by running
    ``fn`` on each entry's flat index."""
    if fn is None or len(stored) != 2:
        return None
    n_in = stored[1]
    try:
        y = fn(np.arange(stored[0] * n_in, dtype=np.int64).reshape(stored))
    except (ValueError, TypeError, DFlashError):
        return None
    if y.ndim != 2 or y.shape[0] != n_in:
        return None
    rows = y[0] // n_in
    return rows if (y == rows[None, :] * n_in + np.arange(n_in)[:, None]).all() else None


def _quantized(path: str, tensors: dict, plan: dict, shapes: dict, dtype: np.dtype) -> dict:
    """``{(key, leaf): QuantizedWeight}``: the leaves whose tensors share one quantized type and
    reach them by whole experts, whole tables or row selections (fields gathered by row, no
    float values); the other leaves are read as float (:func:`_read`)."""
    from dflash_jax.formats import gguf_leaves
    from dflash_jax.formats.gguf_quant import quantized_tensor

    by_leaf: dict = {}
    for name, (stored, parts) in plan.items():
        for key, leaf, r, fn in parts:
            by_leaf.setdefault((key, leaf), []).append((name, stored, r, fn))
    ok = {}
    for (key, leaf), parts in by_leaf.items():
        kinds = {gguf_leaves.tensor_format(tensors[n]) for n, *_ in parts if n in tensors}
        if len(kinds) != 1 or "float" in kinds:
            continue
        how = [(leaf or key) in gguf_leaves.TABLES and fn is None and "table" or len(stored) == 3 and "experts"
               or _rows_of(fn, stored) for _, stored, _, fn in parts]
        if all(h is not None and h is not False for h in how):
            ok[(key, leaf)] = how
    out, cache = {}, {}
    for (key, leaf), how in ok.items():
        full, buf, qw = shapes[key][leaf] if leaf else shapes[key], None, None
        for (name, stored, r, fn), h in zip(by_leaf[(key, leaf)], how):
            whole = cache[name] = cache.get(name) or quantized_tensor(tensors[name], path, str(np.dtype(dtype)))
            qw = whole if isinstance(h, str) else whole.replace(fields={k: a[h] for k, a in whole.fields.items()})
            got, want = (qw.shape[::-1] if isinstance(h, str) and h == "table" else qw.shape), (full if r is None else full[1:])
            if tuple(got) != tuple(want):
                raise DFlashError(f"{path}: tensor {name}", f"{qw.format} weight of shape {list(got)}", f"{list(want)} for this config")
            if r is None:
                break
            buf = buf or {k: np.empty((full[0],) + a.shape, a.dtype) for k, a in qw.fields.items()}
            for k, a in qw.fields.items():
                buf[k][r] = a
        out[(key, leaf)] = qw if buf is None else qw.replace(fields=buf)
    return out


def _read(path: str, tensors: dict, plan: dict, shapes: dict, dtype: np.dtype, model: str, weights: str = "float") -> dict:
    """The params tree of numpy arrays filled by ``plan`` (:func:`gguf_plan`); a stored tensor
    whose shape differs only by unit dims (ggml's ``[H, 1]`` of a ``[H]`` gate) is reshaped. With
    ``weights="quantized"``, the leaves :func:`_quantized` keeps are QuantizedWeights.
    Raises DFlashError for a missing, unexpected (:func:`~dflash_jax.formats.gguf_file.empty_params`) or
    mis-shaped tensor (file and tensor named)."""
    empty_params(path, tensors, plan, {}, dtype, model)
    quantized = _quantized(path, tensors, plan, shapes, dtype) if weights == "quantized" else {}
    out = empty_params(path, tensors, plan, shapes, dtype, model, skip=quantized)
    for (key, leaf), qw in quantized.items():
        out[key] = qw if not leaf else dict(out[key], **{leaf: qw})
    for name, (stored, parts) in plan.items():
        parts = [p for p in parts if (p[0], p[1]) not in quantized]
        if not parts:
            continue
        x = dequantize_tensor(tensors[name], path)
        if x.shape != tuple(stored) and [d for d in x.shape if d != 1] == [d for d in stored if d != 1]:
            x = x.reshape(stored)
        if x.shape != tuple(stored):
            raise DFlashError(f"{path}: tensor {name}", f"ggml shape {list(reversed(x.shape))}", f"{list(reversed(stored))} for this config")
        for key, leaf, r, fn in parts:
            dst = out[key][leaf] if leaf else out[key]
            try:
                y = x if fn is None else fn(x)
            except DFlashError as e:
                raise DFlashError(f"{path}: tensor {name}", e.what, e.expected) from None
            if r is None:
                dst[...] = y
            else:
                dst[r] = y
    return out


def load_qwen3_5_gguf_target(path: str | os.PathLike, dtype: Any = "float32", *, as_numpy: bool = False,
                             weights: str = "float") -> tuple[Qwen3_5Config, dict]:
    """Loads a ``qwen35`` / ``qwen35moe`` / ``qwen3next`` GGUF as ``(Qwen3_5Config, params)``, one
    tensor at a time (no float32 cache).

    Args:
      path: the ``.gguf`` file (any tensor type :func:`dflash_jax.formats.gguf_file.dequantize_tensor` reads).
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); weights are
        dequantized to float32, then cast.
      as_numpy: numpy leaves instead of jax arrays.
      weights: ``"float"``, or ``"quantized"`` (``"auto"``): quantized matrices, experts and the
        embedding stay quantized where a stacked leaf's layers share one type (:func:`_quantized`;
        the fused ``attn_qkv`` / ``attn_q`` split by rows, still quantized).
    Returns:
      The config and the params of :mod:`dflash_jax.families.qwen3_5.model` (``[in, out]`` weights, layers
      stacked per type), those :func:`dflash_jax.families.qwen3_5.safetensors.load_qwen3_5_target` gives for the
      source safetensors.
    Raises:
      DFlashError: as :func:`qwen3_5_gguf_config`; a missing, unexpected or mis-shaped tensor, or an
        ``ssm_a`` that is not negative (file and tensor named).
    """
    import jax

    from dflash_jax.families.qwen3_5.model import MODEL

    from dflash_jax.formats.gguf_leaves import check_weights

    path, target, weights = str(path), numpy_dtype(dtype), check_weights(weights)
    cfg, tensors = qwen3_5_gguf_config(open_gguf(path), path, target.name)
    arch = next(a for a, v in ARCHS.items() if v == cfg.variant)
    out = _read(path, tensors, gguf_plan(cfg), MODEL.param_shapes(cfg), target, f"a {cfg.num_hidden_layers}-layer {arch} model", weights)
    return cfg, (out if as_numpy else jax.device_put(out))
