"""Tiny GGUF files for tests: a writer (``gguf.GGUFWriter``) and dense models laid out as
``convert_hf_to_gguf.py`` writes them."""

from __future__ import annotations

import gguf
import jax
import numpy as np

from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.families.dense import gguf as G

Q = gguf.GGMLQuantizationType


def write_gguf(path, arch: str, kv: dict, tensors: list, tokens: list[str] | None = None):
    """Writes a GGUF; ``tensors`` holds (name, float32 array, qtype or None) in numpy order, or
    (name, uint8 blocks, qtype) already quantized (:func:`kquant_bytes`)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges([])
    for name, arr, qtype in tensors:
        if qtype is None or qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float16))
        elif arr.dtype == np.uint8:  # blocks already quantized (kquant_bytes)
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def tiny_cfg(family="llama", tie=False) -> TargetConfig:
    return TargetConfig(
        family=family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16 if family == "qwen3" else 8, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, qkv_bias=family == "qwen2", qk_norm=family == "qwen3", max_position_embeddings=512,
    )


def model_tensors(cfg: TargetConfig, params: dict, qtype=None) -> list:
    """HF-layout params -> GGUF tensors as convert_hf_to_gguf writes them (numpy order [out, in])."""
    p = jax.tree_util.tree_map(np.asarray, params)
    out = [("token_embd.weight", p["embed"], qtype), ("output_norm.weight", p["norm"], None)]
    if "lm_head" in p:
        out.append(("output.weight", p["lm_head"].T, qtype))
    for i in range(cfg.num_hidden_layers):
        lp = {k: v[i] for k, v in p["layers"].items()}
        for key, gname in G._PARAM_TO_GGUF.items():
            if key not in lp:
                continue
            w = lp[key].T if key in G._MATRICES else lp[key]
            if cfg.family == "llama" and key in ("wq", "bq"):
                w = G.permute_qk(w, cfg.num_attention_heads)
            if cfg.family == "llama" and key in ("wk", "bk"):
                w = G.permute_qk(w, cfg.num_key_value_heads)
            out.append((f"blk.{i}.{gname}", w, qtype if key in G._MATRICES else None))
    return out


def model_kv(cfg: TargetConfig) -> dict:
    a = cfg.family
    return {
        f"{a}.embedding_length": cfg.hidden_size, f"{a}.block_count": cfg.num_hidden_layers,
        f"{a}.feed_forward_length": cfg.intermediate_size, f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads, f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, f"{a}.rope.freq_base": cfg.rope.theta,
        f"{a}.context_length": cfg.max_position_embeddings,
    }


def tokens_for(cfg):
    return [f"t{i}" for i in range(cfg.vocab_size)]


def write_model(path, cfg, params, *, tensors=None, tokens=None, qtype=None):
    return write_gguf(path, cfg.family, model_kv(cfg), tensors if tensors is not None else model_tensors(cfg, params, qtype),
                      tokens if tokens is not None else tokens_for(cfg))


def rewrite_gguf(src, dst, convert) -> dict:
    """Copies the GGUF ``src`` to ``dst``, every metadata key as it is and each tensor as
    ``convert(tensor) -> (array, raw_dtype or None, type name)`` gives it. Returns ``{tensor name:
    type name}`` of ``dst``."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        w.add_key_value(key, f.contents(), vtype, f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    types = {}
    for t in r.tensors:
        data, raw_dtype, types[t.name] = convert(t)
        w.add_tensor(t.name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def requantize(src, dst, choose) -> dict:
    """Copies the GGUF ``src`` to ``dst`` with the float tensors ``choose(name, numpy shape)`` names a
    type for (``"Q8_0"``, ``"Q4_0"``, ... that ``gguf.quants.quantize`` writes) quantized from their
    float32 values; other tensors (quantized ones too) as they are, every metadata key copied.
    Returns ``{tensor name: type name}`` of ``dst``."""
    from dflash_jax.formats.gguf_file import dequantize_tensor

    def convert(t):
        is_float = t.tensor_type in (Q.F32, Q.F16)
        kind = choose(t.name, tuple(reversed([int(d) for d in t.shape]))) if is_float else None
        if kind is not None:
            return gguf.quants.quantize(dequantize_tensor(t, str(src)), Q[kind]), Q[kind], kind
        return np.array(t.data), None if is_float else t.tensor_type, t.tensor_type.name

    return rewrite_gguf(src, dst, convert)


K_F16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of d (, dmin)


def kquant_bytes(kind: str, shape: tuple, rng, d: float = 0.05) -> np.ndarray:
    """Valid random blocks of a K-quant (gguf-py reads K-quants but does not write them) for a
    tensor of numpy ``shape [*lead, out, in]`` (``in`` a multiple of 256): random bytes with the
    float16 super-block scales drawn in ``[-d, d]``; uint8 ``[*lead, out, row bytes]``."""
    qtype = Q[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for at in K_F16_AT[kind]:
        blocks[:, at:at + 2] = rng.uniform(-d, d, n).astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(tuple(shape[:-1]) + (shape[-1] // block * nbytes,))
