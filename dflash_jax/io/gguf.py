"""GGUF target checkpoints (llama.cpp format) -> :class:`TargetConfig` and a dense param pytree.

Supported architectures: ``llama`` (SmolLM2, Llama 2/3, Mistral), ``qwen2`` and ``qwen3``;
``laguna`` files are handed to :mod:`dflash_jax.io.laguna_gguf` by :func:`load_gguf_target`.
Tensors are read one at a time from the memory-mapped file and dequantized with
``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and the
other types ``gguf`` can dequantize), then laid out as described in
:mod:`dflash_jax.models.dense` (``[in, out]`` weights, layers stacked on a leading axis).

Layout facts (``gguf`` / ``convert_hf_to_gguf.py``):

* GGUF stores dims in ggml order (``ne[0]`` innermost), so ``tensor.shape`` is the numpy shape
  reversed; ``tensor.data`` of a quantized tensor is raw bytes ``[rows, bytes_per_row]`` and
  ``dequantize`` returns the numpy-order logical shape. A torch ``[out, in]`` weight reads back as
  numpy ``[out, in]``.
* For ``llama`` the converter permutes the rows of ``q_proj`` / ``k_proj`` (weights and biases)
  from the rotate-half layout to the interleaved one llama.cpp's rope uses:
  ``w.reshape(n_head, 2, D // 2, ...).swapaxes(1, 2)``. :func:`unpermute_qk` undoes it, because
  :mod:`dflash_jax.nn.rope` uses the rotate-half (NeoX / transformers) convention.
* Llama-3.1-style rope scaling is stored as a ``rope_freqs.weight`` tensor (per-frequency divisors)
  instead of metadata; it is matched against the known Llama-3 scaling parameters.

A float32 copy of the converted parameters is cached next to the GGUF as
``<file>.f32.safetensors`` (keyed by the GGUF's size and mtime), so a second load skips the
dequantization. Nothing is pickled.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflash_jax.io.files import atomic_path
from dflash_jax.config import RopeConfig, TargetConfig
from dflash_jax.errors import DFlashError

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # dense; "laguna" is dispatched in load_gguf_target

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

_CACHE_FORMAT = "dflash_jax.gguf.f32/1"
_CACHE_SUFFIX = ".f32.safetensors"

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


# ----------------------------------------------------------------------------------- reading


def open_gguf(path: str | os.PathLike):
    """Opens (memory-maps) a GGUF file with ``gguf.GGUFReader``.

    Returns:
      the ``gguf.GGUFReader``.
    Raises:
      DFlashError: the file is missing, truncated or not a GGUF file (the message names it).
    """
    import gguf

    path = str(path)
    if not os.path.isfile(path):
        raise DFlashError(path, "file not found", "an existing .gguf file")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, struct/IndexError, OSError on bad files
        raise DFlashError(path, f"truncated or corrupt GGUF file ({type(e).__name__}: {e})", "a complete GGUF v2/v3 file") from None


def reader_name(reader) -> str:
    """The file name behind a ``gguf.GGUFReader`` (for error messages)."""
    return str(getattr(getattr(reader, "data", None), "filename", None) or "gguf")


def metadata(reader, key: str, default: Any = None) -> Any:
    """The decoded value of GGUF metadata ``key`` (int/float/bool/str or a list), ``default`` if absent.

    Raises:
      DFlashError: the field exists but cannot be decoded (names the file and key).
    """
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:
        raise DFlashError(f"{reader_name(reader)}: metadata {key}", f"unreadable ({type(e).__name__}: {e})") from None


def dequantize_tensor(tensor, source: str = "gguf") -> np.ndarray:
    """Dequantizes one ``gguf`` ``ReaderTensor`` to float32 in numpy order.

    Args:
      tensor: an entry of ``GGUFReader.tensors``.
      source: the file name, for error messages.
    Returns:
      ``np.ndarray`` float32 of shape ``tuple(reversed(tensor.shape))``.
    Raises:
      DFlashError: unsupported quantization type, or data that does not match the declared shape
        (a truncated file); the message names the file and tensor.
    """
    import gguf

    where = f"{source}: tensor {tensor.name}"
    shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))
    qtype = tensor.tensor_type
    try:
        if qtype == gguf.GGMLQuantizationType.F32:
            out = np.array(tensor.data, dtype=np.float32)  # a copy, not a view of the memory map
        elif qtype == gguf.GGMLQuantizationType.F16:
            out = np.asarray(tensor.data).view(np.float16).astype(np.float32)
        else:
            out = gguf.quants.dequantize(np.asarray(tensor.data), qtype).astype(np.float32, copy=False)
    except NotImplementedError:
        raise DFlashError(where, f"quantization type {qtype.name} cannot be dequantized", "F32/F16/BF16/Q*_0/Q*_1/Q*_K") from None
    except Exception as e:
        raise DFlashError(where, f"cannot decode {qtype.name} data ({type(e).__name__}: {e})") from None
    if out.size != math.prod(shape):
        raise DFlashError(where, f"{out.size} values for shape {list(shape)} (truncated file?)", f"{math.prod(shape)}")
    return out.reshape(shape)


def _f32(value) -> float:
    """GGUF stores floats as float32: take the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _arch_config(reader, path: str) -> tuple[str, dict]:
    arch = metadata(reader, "general.architecture")
    if arch is None:
        raise DFlashError(f"{path}: metadata general.architecture", "missing", f"one of {ARCHITECTURES + ('laguna',)}")
    if arch not in ARCHITECTURES:
        raise DFlashError(f"{path}: metadata general.architecture", f"unsupported value {arch!r}", f"one of {ARCHITECTURES + ('laguna',)}")

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
        ffn=req("feed_forward_length"),
        heads=req("attention.head_count"),
        eps=_f32(req("attention.layer_norm_rms_epsilon", (int, float))),
        theta=_f32(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
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
    meta["vocab_meta"] = metadata(reader, f"{arch}.vocab_size")
    return arch, meta


def _rope(meta: dict, rope_freqs: np.ndarray | None, path: str) -> RopeConfig:
    partial = meta["rot_dim"] / meta["head_dim"]
    scaling = meta["scaling"]
    if scaling in (None, "none") and rope_freqs is None:
        return RopeConfig(theta=meta["theta"], partial=partial)
    if scaling == "linear" and rope_freqs is None:
        return RopeConfig(theta=meta["theta"], kind="linear", factor=_f32(meta["scaling_factor"] or 1.0), partial=partial)
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


def _tokenizer_vocab(reader) -> int | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    return None if field is None else len(field.data)


def _build_config(reader, path: str, dtype: str) -> tuple[TargetConfig, dict]:
    """Config from metadata plus tensor presence (biases, tied head). Returns (cfg, tensors by name)."""
    arch, meta = _arch_config(reader, path)
    tensors = {}
    for t in reader.tensors:
        if t.name in tensors:
            raise DFlashError(f"{path}: tensor {t.name}", "appears twice", "unique tensor names")
        tensors[t.name] = t
    if "token_embd.weight" not in tensors:
        raise DFlashError(f"{path}: tensor token_embd.weight", "missing", "the token embedding")
    emb_shape = [int(x) for x in tensors["token_embd.weight"].shape]  # ggml order [H, V]
    if len(emb_shape) != 2:
        raise DFlashError(f"{path}: tensor token_embd.weight", f"ggml shape {emb_shape}", "2 dims [hidden, vocab]")
    vocab = emb_shape[1]
    n_tok = _tokenizer_vocab(reader)
    if n_tok is not None and n_tok != vocab:
        raise DFlashError(
            f"{path}: tokenizer.ggml.tokens", f"{n_tok} tokens but tensor token_embd.weight has {vocab} rows", "equal sizes"
        )
    if meta["vocab_meta"] is not None and int(meta["vocab_meta"]) != vocab:
        raise DFlashError(
            f"{path}: metadata {arch}.vocab_size", f"{meta['vocab_meta']} but tensor token_embd.weight has {vocab} rows", "equal sizes"
        )
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
        rope=_rope(meta, rope_freqs, path),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=arch == "llama" and has("ffn_gate.bias"),
        qk_norm=arch == "qwen3",
        max_position_embeddings=meta["ctx"],
        dtype=str(dtype),
    )
    return cfg, tensors


def _convert(reader, cfg: TargetConfig, tensors: dict, path: str, progress: Callable[[str], None] | None) -> dict:
    """Dequantizes every tensor into preallocated float32 arrays (the dense.py pytree, numpy)."""
    from dflash_jax.models.dense import param_shapes

    shapes = param_shapes(cfg)
    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if "lm_head" in shapes else set())
    for i in range(cfg.num_hidden_layers):
        expected |= {f"blk.{i}.{_PARAM_TO_GGUF[k]}" for k in shapes["layers"]}
    allowed_extra = {"rope_freqs.weight"} if cfg.rope.kind == "llama3" else set()
    for name in sorted(expected - set(tensors)):
        raise DFlashError(f"{path}: tensor {name}", "missing", f"all tensors of a {cfg.num_hidden_layers}-layer {cfg.family} model")
    for name in sorted(set(tensors) - expected - allowed_extra):
        raise DFlashError(f"{path}: tensor {name}", "unexpected", f"only the tensors of a {cfg.family} model")

    def load(name: str, want: tuple) -> np.ndarray:
        t = tensors[name]
        np_shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        if np_shape != tuple(want):
            ggml = list(reversed(want))
            raise DFlashError(f"{path}: tensor {name}", f"ggml shape {[int(x) for x in t.shape]}", f"{ggml}")
        return dequantize_tensor(t, path)

    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Any] = {"embed": load("token_embd.weight", (V, H)), "norm": load("output_norm.weight", (H,))}
    if "lm_head" in shapes:
        out["lm_head"] = np.ascontiguousarray(load("output.weight", (V, H)).T)
    layers = {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()}
    for i in range(cfg.num_hidden_layers):
        if progress is not None:
            progress(f"layer {i + 1}/{cfg.num_hidden_layers}")
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


# ----------------------------------------------------------------------------------- cache


def cache_path(path: str | os.PathLike) -> Path:
    """Where the float32 cache of ``path`` lives: ``<path>.f32.safetensors``."""
    return Path(str(path) + _CACHE_SUFFIX)


def _cache_key(path: str) -> str:
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def _flatten(params: dict) -> dict[str, np.ndarray]:
    flat = {k: v for k, v in params.items() if k != "layers"}
    flat.update({f"layers.{k}": v for k, v in params["layers"].items()})
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    params: dict[str, Any] = {"layers": {}}
    for k, v in flat.items():
        if k.startswith("layers."):
            params["layers"][k[len("layers."):]] = v
        else:
            params[k] = v
    return params


def _cfg_to_json(cfg: TargetConfig) -> str:
    import dataclasses

    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def _cfg_from_json(text: str) -> TargetConfig:
    d = json.loads(text)
    d["rope"] = RopeConfig(**d["rope"])
    return TargetConfig(**d)


def _read_cache(path: str) -> tuple[TargetConfig, dict] | None:
    cpath = cache_path(path)
    if not cpath.is_file():
        return None
    try:
        from safetensors import safe_open
        from safetensors.numpy import load_file

        with safe_open(str(cpath), framework="numpy") as f:
            meta = f.metadata() or {}
        if meta.get("format") != _CACHE_FORMAT or meta.get("source_key") != _cache_key(path):
            return None
        cfg = _cfg_from_json(meta["config"])
        params = _unflatten(load_file(str(cpath)))
        from dflash_jax.models.dense import param_shapes

        import jax

        want = param_shapes(cfg)
        got = jax.tree_util.tree_map(lambda a: tuple(a.shape), params)
        if jax.tree_util.tree_structure(want, is_leaf=lambda x: isinstance(x, tuple)) != jax.tree_util.tree_structure(
            got, is_leaf=lambda x: isinstance(x, tuple)
        ) or want != got:
            return None
        return cfg, params
    except Exception:  # a stale or damaged cache is rebuilt, never trusted
        return None


def _write_cache(path: str, cfg: TargetConfig, params: dict) -> None:
    from safetensors.numpy import save_file

    cpath = cache_path(path)
    meta = {"format": _CACHE_FORMAT, "source_key": _cache_key(path), "config": _cfg_to_json(cfg.with_dtype("float32"))}
    try:
        with atomic_path(cpath) as tmp:
            save_file(_flatten(params), str(tmp), metadata=meta)
    except OSError as e:  # read-only directory, full disk: loading still works, just slower next time
        print(f"dflash_jax: could not write the weight cache {cpath} ({e})", file=sys.stderr)


# ----------------------------------------------------------------------------------- public


def load_gguf_config(path: str | os.PathLike, dtype: str = "float32") -> TargetConfig:
    """The :class:`TargetConfig` of a GGUF target, from its metadata and tensor list only
    (a :class:`~dflash_jax.config_laguna.LagunaConfig` for a ``laguna`` file).

    Raises:
      DFlashError: as :func:`load_gguf_target` for metadata problems.
    """
    reader = open_gguf(path)
    if metadata(reader, "general.architecture") == "laguna":
        from dflash_jax.io.laguna_gguf import laguna_gguf_config

        return laguna_gguf_config(reader, str(path), dtype)[0]
    return _build_config(reader, str(path), dtype)[0]


def load_gguf_target(
    path: str | os.PathLike,
    dtype: str = "float32",
    *,
    use_cache: bool = True,
    as_numpy: bool = False,
) -> tuple[TargetConfig, dict]:
    """Loads a GGUF target as config and parameters: dense ``llama``, ``qwen2``, ``qwen3``, or
    ``laguna`` (dispatched to :func:`dflash_jax.io.laguna_gguf.load_laguna_gguf_target`, which
    returns ``(LagunaConfig, params of dflash_jax.models.laguna)`` and uses no weight cache).

    Args:
      path: the ``.gguf`` file.
      dtype: parameter and compute dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``);
        weights are dequantized to float32 first, then cast.
      use_cache: read / write ``<path>.f32.safetensors`` (float32 converted weights, keyed by the
        GGUF's size and mtime); a stale or damaged cache is rebuilt.
      as_numpy: return ``np.ndarray`` leaves instead of ``jax.Array`` (for tests and tools).
    Returns:
      ``(cfg, params)``: ``cfg.dtype == dtype``; ``params`` is the pytree of
      :mod:`dflash_jax.models.dense` (``embed [V, H]``, stacked ``layers`` with ``[in, out]``
      weights, ``norm [H]``, ``lm_head [H, V]`` unless the embedding is tied) in ``dtype``.
    Raises:
      DFlashError: the file is missing, truncated or corrupt; an unsupported architecture,
        rope scaling or quantization type; a required metadata key is missing; a tensor is
        missing, unexpected or mis-shaped; the tokenizer's token count disagrees with the
        embedding rows. The message names the file and the tensor or key.
    """
    path = str(path)
    if metadata(open_gguf(path), "general.architecture") == "laguna":
        from dflash_jax.io.laguna_gguf import load_laguna_gguf_target

        return load_laguna_gguf_target(path, dtype, as_numpy=as_numpy)
    cached = _read_cache(path) if use_cache else None
    if cached is not None:
        cfg, params = cached
        cfg = cfg.with_dtype(dtype)
    else:
        reader = open_gguf(path)
        cfg, tensors = _build_config(reader, path, "float32")
        params = _convert(reader, cfg, tensors, path, None)
        del reader, tensors
        if use_cache:
            _write_cache(path, cfg, params)
        cfg = cfg.with_dtype(dtype)
    return cfg, _cast(params, dtype, as_numpy)


def _cast(params: dict, dtype: str, as_numpy: bool) -> dict:
    import jax
    import jax.numpy as jnp

    if as_numpy:
        np_dtype = np.dtype(jnp.dtype(dtype))
        return jax.tree_util.tree_map(lambda a: np.asarray(a, np_dtype), params)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=dtype), params)
