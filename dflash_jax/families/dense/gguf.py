"""GGUF target checkpoints (llama.cpp format) -> :class:`TargetConfig` and a dense param pytree.

Supported architectures: ``llama`` (SmolLM2, Llama 2/3, Mistral), ``qwen2`` and ``qwen3``
(``laguna`` files: :mod:`dflash_jax.families.laguna.gguf`; :mod:`dflash_jax.families.registry` picks the
loader). Tensors are read one at a time from the memory-mapped file and dequantized
(:mod:`dflash_jax.formats.gguf_file`), then laid out as described in :mod:`dflash_jax.families.dense.model`
(``[in, out]`` weights, layers stacked on a leading axis).

Layout facts (``gguf`` / ``convert_hf_to_gguf.py``):

* GGUF stores dims in ggml order (``ne[0]`` innermost), so ``tensor.shape`` is the numpy shape
  reversed; ``tensor.data`` of a quantized tensor is raw bytes ``[rows, bytes_per_row]`` and
  ``dequantize`` returns the numpy-order logical shape. A torch ``[out, in]`` weight reads back as
  numpy ``[out, in]``.
* For ``llama`` the converter permutes the rows of ``q_proj`` / ``k_proj`` (weights and biases)
  from the rotate-half layout to the interleaved one llama.cpp's rope uses:
  ``w.reshape(n_head, 2, D // 2, ...).swapaxes(1, 2)``. :func:`unpermute_qk` undoes it, because
  :mod:`dflash_jax.nn.layer` uses the rotate-half (NeoX / transformers) convention.
* Llama-3.1-style rope scaling is stored as a ``rope_freqs.weight`` tensor (per-frequency divisors)
  instead of metadata; it is matched against the known Llama-3 scaling parameters.

A float32 copy of the converted parameters is cached next to the GGUF in the folder
``<file>.f32`` (:mod:`dflash_jax.families.dense.gguf_cache`), so a second load skips parsing and dequantizing
the GGUF and memory-maps the weights instead. Dequantizing and writing the cache report their
progress on stderr (:mod:`dflash_jax.progress`).
"""

from __future__ import annotations

import math
import os
from typing import Any
import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax import progress
from dflash_jax.families.hf_config import RopeConfig
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.errors import DFlashError
from dflash_jax.runtime.fingerprint import weights_fingerprint
from dflash_jax.families.dense.gguf_cache import cache_nbytes, cache_path, read_cache, write_cache
from dflash_jax.formats.gguf_file import as_f32, dequantize_tensor, embedding_vocab, metadata, open_gguf, tensor_table
from dflash_jax.families.dense.model import MODEL


ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF general.architecture of the dense family

# GGUF per-layer tensor base name -> dense.py layer key, and whether the weight is a [out, in]
# matrix that must be transposed to [in, out].
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_output.bias": "bo",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
    "ffn_gate.bias": "b_gate",
    "ffn_up.bias": "b_up",
    "ffn_down.bias": "b_down",
}
_PARAM_TO_GGUF = {v: k for k, v in _LAYER_TENSORS.items()}
_MATRICES = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}

# Known Llama-3 rope scaling parameters, matched against a GGUF's rope_freqs tensor.
_LLAMA3_SCALINGS = (
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # 3.1
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # 3.2
)


# ----------------------------------------------------------------------------------- permutation


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (``convert_hf_to_gguf.LlamaModel.permute``), for tests.

    Args:
      w: ``[n_head * D, ...]`` rows of an HF ``q_proj`` / ``k_proj`` weight ``[out, in]`` or bias
        ``[out]``, in the rotate-half layout.
      n_head: heads of that projection (``num_attention_heads`` for q, ``num_key_value_heads`` for k).
    Returns:
      Same shape and dtype, rows in llama.cpp's interleaved layout.
    Raises:
      DFlashError: the row count is not a multiple of ``2 * n_head``.
    """
    _check_rows(w, n_head)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`: GGUF q/k rows back to the rotate-half (HF) layout.

    Args:
      w: ``[n_head * D, ...]`` rows as stored in a llama GGUF (numpy order).
      n_head: heads of that projection.
    Returns:
      Same shape and dtype. ``unpermute_qk(permute_qk(w, n), n) == w``.
    Raises:
      DFlashError: the row count is not a multiple of ``2 * n_head``.
    """
    _check_rows(w, n_head)
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_rows(w: np.ndarray, n_head: int) -> None:
    if n_head <= 0 or w.shape[0] % (2 * n_head):
        raise DFlashError("q/k permutation", f"{w.shape[0]} rows for {n_head} heads", "a multiple of 2 * heads")


# ----------------------------------------------------------------------------------- config


def arch_config(reader, path: str, architectures: tuple[str, ...] = ARCHITECTURES, need_ffn: bool = True) -> tuple[str, dict]:
    """``(general.architecture, sizes)`` of a llama.cpp decoder GGUF: ``hidden``, ``layers``,
    ``ffn``, ``heads``, ``kv_heads``, ``head_dim``, ``rot_dim``, ``eps``, ``theta``, ``ctx``,
    ``scaling``, ``scaling_factor`` (keys ``{arch}.embedding_length``, ... as llama.cpp's
    ``llama-arch.cpp`` names them). Shared by the dense, Qwen3-MoE and Qwen3.5 GGUF loaders;
    ``need_ffn`` false: ``feed_forward_length`` may be absent (``ffn`` ``None``; an all-MoE model).

    Raises:
      DFlashError: an architecture not in ``architectures``, or a required key missing or
        ill-typed (file and key named).
    """
    arch = metadata(reader, "general.architecture")
    if arch is None:
        raise DFlashError(f"{path}: metadata general.architecture", "missing", f"one of {architectures}")
    if arch not in architectures:
        raise DFlashError(f"{path}: metadata general.architecture", f"unsupported value {arch!r}", f"one of {architectures}")

    def req(key: str, types=(int,)):
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise DFlashError(f"{path}: metadata {arch}.{key}", "missing", "a value")
        if not isinstance(value, types) or isinstance(value, bool):
            raise DFlashError(f"{path}: metadata {arch}.{key}", f"got {value!r}", " or ".join(t.__name__ for t in types))
        return value

    meta = dict(
        hidden=req("embedding_length"),
        layers=req("block_count"),
        ffn=req("feed_forward_length") if need_ffn or metadata(reader, f"{arch}.feed_forward_length") is not None else None,
        heads=req("attention.head_count"),
        eps=as_f32(req("attention.layer_norm_rms_epsilon", (int, float))),
        theta=as_f32(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        ctx=int(metadata(reader, f"{arch}.context_length", 4096)),
    )
    kv = metadata(reader, f"{arch}.attention.head_count_kv", meta["heads"])
    if isinstance(kv, list):  # per-layer list in some hybrid models; dense models are uniform
        if len(set(kv)) != 1:
            raise DFlashError(f"{path}: metadata {arch}.attention.head_count_kv", f"per-layer values {kv}", "one value")
        kv = kv[0]
    meta["kv_heads"] = int(kv)
    key_len = metadata(reader, f"{arch}.attention.key_length")
    if key_len is None:
        if meta["hidden"] % meta["heads"]:
            raise DFlashError(f"{path}: metadata {arch}.attention.key_length", "missing and embedding_length not divisible by head_count", "a value")
        key_len = meta["hidden"] // meta["heads"]
    meta["head_dim"] = int(key_len)
    meta["rot_dim"] = int(metadata(reader, f"{arch}.rope.dimension_count", meta["head_dim"]))
    meta["scaling"] = metadata(reader, f"{arch}.rope.scaling.type")
    meta["scaling_factor"] = metadata(reader, f"{arch}.rope.scaling.factor")
    return arch, meta


def rope_config(meta: dict, rope_freqs: np.ndarray | None, path: str) -> RopeConfig:
    """The :class:`RopeConfig` of :func:`arch_config`'s sizes (and a ``rope_freqs`` tensor: Llama-3 scaling).
    Raises DFlashError for an unsupported rope scaling."""
    partial = meta["rot_dim"] / meta["head_dim"]
    scaling = meta["scaling"]
    if scaling in (None, "none") and rope_freqs is None:
        return RopeConfig(theta=meta["theta"], partial=partial)
    if scaling == "linear" and rope_freqs is None:
        return RopeConfig(theta=meta["theta"], kind="linear", factor=as_f32(meta["scaling_factor"] or 1.0), partial=partial)
    if rope_freqs is not None and scaling in (None, "none"):
        rot = meta["rot_dim"]
        inv = 1.0 / (meta["theta"] ** (np.arange(0, rot, 2, dtype=np.float64) / rot))
        for params in _LLAMA3_SCALINGS:
            lo = params["original_max_position_embeddings"] / params["low_freq_factor"]
            hi = params["original_max_position_embeddings"] / params["high_freq_factor"]
            wavelen = 2 * math.pi / inv
            smooth = (params["original_max_position_embeddings"] / wavelen - params["low_freq_factor"]) / (
                params["high_freq_factor"] - params["low_freq_factor"]
            )
            expect = np.where(wavelen < hi, 1.0, np.where(wavelen > lo, params["factor"], 1.0 / ((1 - smooth) / params["factor"] + smooth)))
            if rope_freqs.shape == expect.shape and np.allclose(rope_freqs, expect, rtol=1e-4):
                return RopeConfig(theta=meta["theta"], kind="llama3", partial=partial, **params)
        raise DFlashError(f"{path}: tensor rope_freqs.weight", "frequency factors match no known Llama-3 rope scaling", "Llama-3.1/3.2 factors")
    raise DFlashError(f"{path}: metadata rope.scaling.type", f"unsupported rope scaling {scaling!r}", "none or linear")


def gguf_config(reader, path: str, dtype: str) -> tuple[TargetConfig, dict]:
    """:class:`TargetConfig` from a dense GGUF's metadata plus tensor presence (biases, tied head).

    Returns:
      ``(cfg, tensors by name)``.
    Raises:
      DFlashError: as :func:`load_gguf_target` for metadata problems.
    """
    arch, meta = arch_config(reader, path)
    tensors = tensor_table(reader, path)
    vocab = embedding_vocab(reader, tensors, path, f"{arch}.vocab_size")
    rope_freqs = None
    if "rope_freqs.weight" in tensors:
        rope_freqs = dequantize_tensor(tensors["rope_freqs.weight"], path).astype(np.float64)
    has = lambda base: f"blk.0.{base}" in tensors  # noqa: E731
    if arch == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias, o_bias = has("attn_q.bias"), has("attn_output.bias")
    cfg = TargetConfig(
        family=arch,
        vocab_size=vocab,
        hidden_size=meta["hidden"],
        intermediate_size=meta["ffn"],
        num_hidden_layers=meta["layers"],
        num_attention_heads=meta["heads"],
        num_key_value_heads=meta["kv_heads"],
        head_dim=meta["head_dim"],
        rms_norm_eps=meta["eps"],
        rope=rope_config(meta, rope_freqs, path),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=arch == "llama" and has("ffn_gate.bias"),
        qk_norm=arch == "qwen3",
        max_position_embeddings=meta["ctx"],
        dtype=str(dtype),
    )
    return cfg, tensors


def check_tensors(cfg: TargetConfig, tensors: dict, path: str) -> None:
    """Raises DFlashError naming the first tensor missing from, or unexpected in, a dense GGUF of ``cfg``."""
    shapes = MODEL.param_shapes(cfg)
    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if "lm_head" in shapes else set())
    for i in range(cfg.num_hidden_layers):
        expected |= {f"blk.{i}.{_PARAM_TO_GGUF[k]}" for k in shapes["layers"]}
    allowed_extra = {"rope_freqs.weight"} if cfg.rope.kind == "llama3" else set()
    for name in sorted(expected - set(tensors)):
        raise DFlashError(f"{path}: tensor {name}", "missing", f"all tensors of a {cfg.num_hidden_layers}-layer {cfg.family} model")
    for name in sorted(set(tensors) - expected - allowed_extra):
        raise DFlashError(f"{path}: tensor {name}", "unexpected", f"only the tensors of a {cfg.family} model")


def checked(tensors: dict, name: str, want: tuple, path: str):
    """The ``ReaderTensor`` ``name`` once its numpy-order shape is ``want`` (DFlashError naming it otherwise)."""
    t = tensors[name]
    np_shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    if np_shape != tuple(want):
        raise DFlashError(f"{path}: tensor {name}", f"ggml shape {[int(x) for x in t.shape]}", f"{list(reversed(want))}")
    return t


def _convert(reader, cfg: TargetConfig, tensors: dict, path: str) -> dict:
    """Dequantizes every tensor into preallocated float32 arrays (the dense.py pytree, numpy)."""
    check_tensors(cfg, tensors, path)
    shapes = MODEL.param_shapes(cfg)

    def load(name: str, want: tuple) -> np.ndarray:
        return dequantize_tensor(checked(tensors, name, want, path), path)

    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Any] = {"embed": load("token_embd.weight", (V, H)), "norm": load("output_norm.weight", (H,))}
    if "lm_head" in shapes:
        out["lm_head"] = np.ascontiguousarray(load("output.weight", (V, H)).T)
    layers = {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()}
    for i in range(cfg.num_hidden_layers):
        for key, full in shapes["layers"].items():
            want = full[1:]
            if key in _MATRICES:
                want = (want[1], want[0])  # stored [out, in]
            w = load(f"blk.{i}.{_PARAM_TO_GGUF[key]}", want)
            if cfg.family == "llama" and key in ("wq", "bq"):
                w = unpermute_qk(w, cfg.num_attention_heads)
            elif cfg.family == "llama" and key in ("wk", "bk"):
                w = unpermute_qk(w, cfg.num_key_value_heads)
            layers[key][i] = w.T if key in _MATRICES else w
    out["layers"] = layers
    return out


# ----------------------------------------------------------------------------------- public


def load_gguf_target(
    path: str | os.PathLike,
    dtype: str = "float32",
    *,
    use_cache: bool = True,
    as_numpy: bool = False,
) -> tuple[TargetConfig, dict]:
    """Loads a dense GGUF target (``llama``, ``qwen2``, ``qwen3``) as config and parameters
    (:func:`dflash_jax.families.registry.load_gguf_target` picks the family's loader).

    Args:
      path: the ``.gguf`` file.
      dtype: parameter and compute dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``);
        weights are dequantized to float32 first, then cast.
      use_cache: read / write the folder ``<path>.f32`` (float32 converted weights, keyed by the
        GGUF's size and mtime, with their fingerprint); a stale or damaged cache is rebuilt.
      as_numpy: return ``np.ndarray`` leaves instead of ``jax.Array`` (float32 ones from the
        cache are read-only memory maps).
    Returns:
      ``(cfg, params)``: ``cfg.dtype == dtype``; ``params`` is the pytree of
      :mod:`dflash_jax.families.dense.model` (``embed [V, H]``, stacked ``layers`` with ``[in, out]``
      weights, ``norm [H]``, ``lm_head [H, V]`` unless the embedding is tied) in ``dtype``.
    Raises:
      DFlashError: the file is missing, truncated or corrupt; an unsupported architecture,
        rope scaling or quantization type; a required metadata key is missing; a tensor is
        missing, unexpected or mis-shaped; the tokenizer's token count disagrees with the
        embedding rows. The message names the file and the tensor or key.
    """
    path = str(path)
    cached = read_cache(path) if use_cache else None
    if cached is not None:
        cfg, params, _ = cached
    else:
        cfg, params, arch, quantized = _dequantize(path)
        if use_cache:
            where = cache_path(path)
            with progress.step(f"writing the float32 cache {where} ({cache_nbytes(params) / 2**20:.0f} MiB; later loads map it)",
                               "wrote the float32 cache"):
                write_cache(path, cfg, params, arch, weights_fingerprint(cfg, params), quantized)
    return cfg.with_dtype(dtype), _cast(params, dtype, as_numpy)


def _dequantize(path: str) -> tuple[TargetConfig, dict, str, bool]:
    """``(float32 cfg, numpy float32 params, general.architecture, whether it holds quantized
    tensors)`` of a GGUF, dequantized with progress lines on stderr (seconds to minutes: a first load)."""
    name = os.path.basename(path)
    with progress.step(f"dequantizing {name} to float32 (first load of this file)", f"dequantized {name}"):
        reader = open_gguf(path)
        cfg, tensors = gguf_config(reader, path, "float32")
        quantized = any(t.tensor_type.name not in ("F32", "F16", "BF16") for t in tensors.values())
        return cfg, _convert(reader, cfg, tensors, path), metadata(reader, "general.architecture"), quantized


def _cast(params: dict, dtype: str, as_numpy: bool) -> dict:
    """``params`` in ``dtype``: numpy arrays (float32 ones, memory-mapped from the cache, stay
    as they are) or JAX arrays (``jax.device_put``: on the CPU a 64-byte-aligned array is used
    without a copy; cast on the device)."""
    if as_numpy:
        np_dtype = np.dtype(jnp.dtype(dtype))
        return jax.tree_util.tree_map(lambda a: np.asarray(a, np_dtype), params)
    want = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda a: a if a.dtype == want else a.astype(want), jax.device_put(params))
