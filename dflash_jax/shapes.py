"""Model shapes (``tools/gpu_check.py`` measures on them; tests check them): random-weight targets
and drafters shaped like real ones, and the bytes a decode step must read.

Speed does not depend on the weights' values, so the real checkpoints (which do not fit the 64 MiB
that travels to a lent GPU) are replaced by random weights of their exact shapes, built from
``config.json``-style dicts parsed by the package's own parsers:

- ``smollm2-135m``: SmolLM2-135M-Instruct (the default target) with the drafter shipped for it
  (``dflash_jax/assets/drafters/smollm2-135m-instruct/config.json``, draft vocabulary 8192).
- ``qwen3-8b``: Qwen3-8B with the z-lab ``Qwen3-8B-DFlash-b16`` drafter (docs/specs/dflash.md 1.3).
- ``laguna-xs-2.1``: Laguna XS-2.1 (256 experts, top-8) with its DFlash drafter
  (:mod:`dflash_jax.families.laguna.presets`).
- ``qwen3-coder-30b-a3b``: Qwen3-Coder-30B-A3B-Instruct (``Qwen3MoeForCausalLM``: hidden 2048, 48
  layers all sparse, 32 heads, 4 KV heads, head_dim 128, 128 experts of 768, top-8 renormalised,
  vocab 151936; its published ``config.json``) with a DFlash drafter of z-lab's Qwen3-8B layout
  (5 layers, block 16) at hidden 2048 (an assumed drafter shape: speed, not acceptance).
- ``qwen3-8b-fp8``: Qwen3-8B as ``Qwen/Qwen3-8B-FP8`` ships it: the same shapes and drafter, every
  decoder-layer linear weight block-scaled FP8 (:func:`as_fp8`: one byte a weight plus a float32
  scale per 128 inputs of a row; embedding, LM head and norms bf16), computed in bfloat16.
- ``gpt-oss-20b``: gpt-oss-20b (``GptOssForCausalLM``: hidden 2880, 24 layers alternating sliding
  (window 128) and full attention, 64 heads, 8 KV heads, head_dim 64, 32 experts of 2880, top-4,
  vocab 201088, YaRN factor 32 over 4096; its published ``config.json``; experts dequantized from
  MXFP4 as the loaders do) with a DFlash drafter of z-lab's Qwen3 layout (5 layers, block 16) at
  hidden 2880 with the target's attention heads (an assumed drafter shape: speed, not acceptance).

- ``qwen3.8-27b``: a Qwen3.8-27B-shaped hybrid target (``Qwen3_5ForCausalLM``: Gated DeltaNet and
  full attention 3:1, hidden 5120, 64 layers, 24 heads, 4 KV heads, head_dim 256, MLP 17408, vocab
  248320, partial RoPE 0.25, theta 1e7: Qwen3.5-27B's published shape, assumed for Qwen3.8-27B;
  the linear-attention heads, 16 key and 48 value heads of 128, are assumed too) with the
  ``Qwen3.8-27B-DFlash2`` drafter as docs/specs/dflash.md 1.3 gives it (``DFlash2DraftModel``:
  5 sliding layers, window 2048, hidden 5120, 32/8 heads of 128, block 8, ``conv_kernel_size`` 2,
  ``conv_group_size`` 16, ``selector_rank`` 256, ``selector_top_k`` 16, captured layers
  [5, 19, 33, 47, 61]; its MLP width 17408 and mask id 248070 assumed from Qwen3.6-27B-DFlash).

``TINY`` holds the same kinds at toy sizes for ``--dry-run`` on a CPU.

Quantized weights (:func:`quantized_models`, :data:`SCHEMES`): the same shapes with random codes in
the field layout the GGUF loaders keep (:mod:`dflash_jax.formats.gguf_quant`): ``"q4_k_m"`` as
llama.cpp's ``Q4_K_M`` assigns types (``attn_v`` and ``ffn_down`` of the ``use_more_bits`` layers
and the output head ``Q6_K``, every other matrix ``Q4_K``; routers, norms and biases float; a
matrix whose input width is not a multiple of 256 ``Q8_0``) with a ``Q8_0`` drafter; ``"mxfp4"``
as gpt-oss ships: the routed experts MXFP4, the rest float, the drafter float.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import model as drafter_mod
from dflash_jax.nn import params as P
from dflash_jax.nn import quant, quant_fp8
from dflash_jax.nn.quant import QuantizedWeight
from dflash_jax.families.laguna.presets import DRAFTERS, PUBLISHED
from dflash_jax.families.registry import family_for_hf, module_for
from dflash_jax.drafter.model import drafter_config_from_hf

SHIPPED_DRAFTER = Path(__file__).resolve().parent / "assets" / "drafters" / "smollm2-135m-instruct" / "config.json"


def _llama(vocab, hidden, inter, layers, heads, kv, head_dim, theta, tied, arch="LlamaForCausalLM", eps=1e-5, max_pos=8192):
    return {"architectures": [arch], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "rope_theta": theta, "tie_word_embeddings": tied, "rms_norm_eps": eps, "max_position_embeddings": max_pos}


def _dflash(hidden, inter, layers, heads, kv, head_dim, vocab, block, mask, ids, n_target, theta):
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": theta, "num_target_layers": n_target,
            "block_size": block, "dflash_config": {"block_size": block, "mask_token_id": mask, "target_layer_ids": ids}}


def _dflash2(hidden, inter, layers, heads, kv, head_dim, vocab, block, mask, ids, n_target, theta, window, conv, group, rank, top_k):
    d = _dflash(hidden, inter, layers, heads, kv, head_dim, vocab, block, mask, ids, n_target, theta)
    d.update(architectures=["DFlash2DraftModel"], layer_types=["sliding_attention"] * layers, sliding_window=window)
    d["dflash_config"].update(conv_kernel_size=conv, conv_group_size=group, selector_rank=rank, selector_top_k=top_k)
    return d


def _qwen3_5(vocab, hidden, inter, layers, heads, kv, head_dim, lin_k, lin_v, lin_dim, theta=1e7):
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "linear_conv_kernel_dim": 4, "linear_key_head_dim": lin_dim, "linear_value_head_dim": lin_dim,
            "linear_num_key_heads": lin_k, "linear_num_value_heads": lin_v, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
            "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
            "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25}, "max_position_embeddings": 262144}


def _laguna(hidden, layers, heads, kv, head_dim, experts, top_k, moe, window, vocab, inter):
    return dict(PUBLISHED["XS-2.1"], hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
               num_attention_heads_per_layer=[heads] * layers, num_key_value_heads=kv, head_dim=head_dim,
               layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)],
               mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_experts=experts, num_experts_per_tok=top_k,
               moe_intermediate_size=moe, shared_expert_intermediate_size=moe, sliding_window=window, vocab_size=vocab,
               intermediate_size=inter, max_position_embeddings=4096)


def _qwen3_moe(vocab, hidden, inter, layers, heads, kv, head_dim, experts, top_k, moe, theta=1e7, max_pos=262144):
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": theta, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "max_position_embeddings": max_pos}


def _gpt_oss(vocab, hidden, inter, layers, heads, kv, head_dim, experts, top_k, window, orig=4096, max_pos=131072):
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "num_local_experts": experts, "num_experts_per_tok": top_k, "sliding_window": window,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)], "attention_bias": True,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": orig},
            "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "tie_word_embeddings": False,
            "max_position_embeddings": max_pos}


def _laguna_drafter(hidden, layers, heads, kv, head_dim, inter, vocab, ids, n_target, window):
    d = json.loads(json.dumps(DRAFTERS["XS-2.1"]))
    d.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
             intermediate_size=inter, vocab_size=vocab, draft_vocab_size=vocab, layer_types=["sliding_attention"] * layers,
             sliding_window=window)
    d["dflash_config"].update(block_size=8, mask_token_id=vocab - 1, target_layer_ids=ids, num_target_layers=n_target)
    return d


def _shipped_drafter() -> dict:
    """The shipped SmolLM2 drafter's ``config.json``."""
    return json.loads(SHIPPED_DRAFTER.read_text(encoding="utf-8"))


# name -> (target config.json dict, drafter config.json dict, draft vocabulary size or 0)
REAL = {
    "smollm2-135m": (lambda: _llama(49152, 576, 1536, 30, 9, 3, 64, 100000.0, True), _shipped_drafter, 8192),
    "qwen3-8b": (lambda: _llama(151936, 4096, 12288, 36, 32, 8, 128, 1e6, False, "Qwen3ForCausalLM", 1e-6, 40960),
                 lambda: _dflash(4096, 12288, 5, 32, 8, 128, 151936, 16, 151669, [1, 9, 17, 25, 33], 36, 1e6), 0),
    "laguna-xs-2.1": (lambda: PUBLISHED["XS-2.1"], lambda: DRAFTERS["XS-2.1"], 0),
    "qwen3-coder-30b-a3b": (lambda: _qwen3_moe(151936, 2048, 6144, 48, 32, 4, 128, 128, 8, 768),
                            lambda: _dflash(2048, 6144, 5, 32, 4, 128, 151936, 16, 151669, [1, 12, 23, 34, 45], 48, 1e7), 0),
    "gpt-oss-20b": (lambda: _gpt_oss(201088, 2880, 2880, 24, 64, 8, 64, 32, 4, 128),
                    lambda: _dflash(2880, 7680, 5, 64, 8, 64, 201088, 16, 200017, [1, 6, 11, 16, 21], 24, 150000.0), 0),
    "qwen3.8-27b": (lambda: _qwen3_5(248320, 5120, 17408, 64, 24, 4, 256, 16, 48, 128),
                    lambda: _dflash2(5120, 17408, 5, 32, 8, 128, 248320, 8, 248070, [5, 19, 33, 47, 61], 64, 1e7, 2048, 2, 16, 256, 16), 0),
}
REAL["qwen3-8b-fp8"] = REAL["qwen3-8b"]  # the shapes of Qwen3-8B; random_models(...) then as_fp8(...)
FP8_LEAVES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # what Qwen3-8B-FP8 stores in FP8
TINY = {
    "smollm2-135m": (lambda: _llama(512, 64, 128, 4, 4, 2, 16, 100000.0, True),
                     lambda: _dflash(64, 96, 1, 4, 2, 16, 512, 8, 511, [1, 2], 4, 100000.0), 128),
    "qwen3-8b": (lambda: _llama(512, 64, 128, 4, 4, 2, 16, 1e6, False, "Qwen3ForCausalLM", 1e-6),
                 lambda: _dflash(64, 96, 2, 4, 2, 16, 512, 8, 511, [0, 3], 4, 1e6), 0),
    "laguna-xs-2.1": (lambda: _laguna(64, 5, 4, 2, 16, 8, 2, 32, 32, 512, 128),  # full+dense, sliding+MoE x3, full+MoE
                      lambda: _laguna_drafter(64, 2, 4, 2, 16, 96, 512, [1, 4], 5, 32), 0),
    "qwen3-coder-30b-a3b": (lambda: _qwen3_moe(512, 64, 128, 4, 4, 2, 16, 8, 2, 32, 1e6, 4096),
                            lambda: _dflash(64, 96, 2, 4, 2, 16, 512, 8, 511, [0, 3], 4, 1e6), 0),
    "gpt-oss-20b": (lambda: _gpt_oss(512, 64, 32, 4, 4, 2, 16, 8, 2, 32, 16, 4096),
                    lambda: _dflash(64, 96, 2, 4, 2, 16, 512, 8, 511, [0, 3], 4, 150000.0), 0),
    "qwen3.8-27b": (lambda: _qwen3_5(512, 64, 128, 4, 4, 2, 16, 2, 4, 8),
                    lambda: _dflash2(64, 96, 2, 4, 2, 16, 512, 8, 511, [0, 3], 4, 1e7, 32, 2, 16, 16, 8), 0),
}


TINY["qwen3-8b-fp8"] = TINY["qwen3-8b"]


def configs(name: str, dtype: str, tiny: bool = False):
    """``(target cfg, drafter cfg)`` of the shape ``name`` (a key of :data:`REAL`) in ``dtype``."""
    target_hf, drafter_hf, draft_vocab = (TINY if tiny else REAL)[name]
    t = target_hf()
    cfg = family_for_hf(t).parse_hf(t, name).with_dtype(dtype)
    dcfg = drafter_config_from_hf(drafter_hf(), f"{name} drafter").with_dtype(dtype)
    if draft_vocab:
        dcfg = dataclasses.replace(dcfg, draft_vocab_size=draft_vocab)
    return cfg, dcfg


@functools.lru_cache(maxsize=None)
def _initializers(cfg, dcfg) -> list:
    """``(model, group, jitted initializer)`` for each top-level group of the target's and the
    drafter's parameter specs (built once per pair of configs)."""
    out = []
    for model, specs, dtype in (("target", module_for(cfg).param_specs(cfg), cfg.dtype),
                                ("drafter", drafter_mod.param_specs(dcfg), dcfg.dtype)):
        out += [(model, name, jax.jit(functools.partial(P.init, group, scale=0.02, dtype=dtype))) for name, group in specs.items()]
    return out


def random_models(cfg, dcfg, seed: int = 0):
    """``(target params, drafter params)``: random weights of the configs' shapes and dtype, drawn
    as ``init_params`` draws them (scale 0.02), on the device, one compiled program per top-level
    group of leaves (a whole stack of layers at most), so the device never holds more than one
    group's temporaries. XLA's own generator (``impl="rbg"``) keeps the programs quick to compile."""
    key = jax.random.key(seed, impl="rbg")
    out = {"target": {}, "drafter": {}}
    for i, (model, name, init) in enumerate(_initializers(cfg, dcfg)):
        out[model][name] = init(jax.random.fold_in(key, i))
    return out["target"], out["drafter"]


def as_fp8(params: dict) -> dict:
    """A dense target's params with every decoder-layer linear weight (:data:`FP8_LEAVES`, stacked
    ``[L, in, out]``) as a block-scaled FP8 :class:`~dflash_jax.nn.quant.QuantizedWeight`
    (:mod:`dflash_jax.nn.quant_fp8`): codes the float weights cast to ``float8_e4m3fn``
    ``[L, out, in]``, scales 1 (random codes: speed does not depend on their values), converted on
    the device one leaf at a time."""
    layers = dict(params["layers"])
    for k in FP8_LEAVES:
        layers[k] = _fp8_leaf(layers[k])
    return dict(params, layers=layers)


@jax.jit
def _fp8_leaf(w):
    codes = jnp.swapaxes(w, -1, -2).astype(quant_fp8.CODE_DTYPE)
    scale = jnp.ones(codes.shape[:-1] + (-(-codes.shape[-1] // quant_fp8.BLOCK_IN),), jnp.float32)
    return quant.QuantizedWeight({"codes": codes, "scale": scale}, quant_fp8.format_name(), jnp.dtype(w.dtype).name)


def tree_bytes(tree) -> int:
    """Bytes of every array of a pytree."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def weight_bytes_per_token(params, cfg, batch: int = 1) -> int:
    """The fewest weight bytes one decode step of ``batch`` rows must read: every weight once,
    except the embedding table when the LM head is separate (``batch`` rows of it), and, of a
    mixture of experts, only the experts the rows can choose (``min(E, batch * top_k)``). A
    quantized weight counts the bytes of its fields."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=quant.is_quantized):
        name = jax.tree_util.keystr(path[-1:]).strip("[]'\"")
        n = x.nbytes if quant.is_quantized(x) else int(x.size) * x.dtype.itemsize
        if name == "embed" and "lm_head" in params:
            n = batch * n // (x.out_features if quant.is_quantized(x) else x.shape[0])
        elif name in ("e_gate", "e_up", "e_down"):
            n = n * min(cfg.num_experts, batch * cfg.num_experts_per_tok) // cfg.num_experts
        total += n
    return total


def kv_bytes_live(cache, capacity: int, live: int, window: int = 0) -> int:
    """Bytes of K/V a step over ``live`` cached positions must read: every K/V array of ``cache``
    (``[..., B, S, Hkv, D]``) counts ``live`` rows when ``S`` is the capacity, else (a sliding
    layer's ring) ``min(live, window)`` rows."""
    total = 0
    for x in jax.tree_util.tree_leaves(cache):
        if x.ndim < 4:
            continue
        rows = live if x.shape[-3] == capacity else min(live, window)
        total += int(np.prod(x.shape[:-3])) * rows * int(np.prod(x.shape[-2:])) * x.dtype.itemsize
    return total


SCHEMES = ("q4_k_m", "mxfp4")
_MORE_BITS = ("wv", "w_down", "e_down", "s_down")  # llama.cpp's attn_v / ffn_down categories
_KEEP_FLOAT = ("router", "s_router")


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp ``use_more_bits``: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def leaf_type(scheme: str, name: str, layer: int | None, n_layers: int, n_in: int, drafter: bool = False) -> str | None:
    """The GGML type ``scheme`` gives the leaf ``name`` (of decoder layer ``layer``, None for the
    embedding and head) of input width ``n_in``, or ``None`` (float)."""
    matrix = name in ("embed", "lm_head", "fc") or (name.startswith(("w", "e_", "s_", "pl_")) and name not in _KEEP_FLOAT)
    if not matrix or n_in % 32:
        return None
    if scheme == "mxfp4":
        return "MXFP4" if name.startswith("e_") and not drafter else None
    if drafter:
        return "Q8_0"
    if n_in % 256:
        return "Q8_0"
    more = name == "lm_head" or (name in _MORE_BITS and layer is not None and _use_more_bits(layer, n_layers))
    return "Q6_K" if more else "Q4_K"


@functools.lru_cache(maxsize=None)
def _field_layout(kind: str) -> tuple:
    """``((field, per-block width, dtype), ...)``, ``block``: the fields one block of ``kind`` gives."""
    from types import SimpleNamespace

    import gguf

    from dflash_jax.formats.gguf_quant import block_bytes, quantized_tensor

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    probe = SimpleNamespace(name="probe", tensor_type=gguf.GGMLQuantizationType[kind], shape=[block, 1],
                            data=np.zeros(block_bytes(kind), np.uint8))
    qw = quantized_tensor(probe, "probe")
    return tuple((k, a.shape[-1], a.dtype.name) for k, a in qw.fields.items()), block, qw.format


def random_quantized(key, kind: str, lead: tuple, n_in: int, n_out: int, dtype: str) -> QuantizedWeight:
    """A :class:`QuantizedWeight` ``[*lead, n_in, n_out]`` of ``kind`` with random codes and small
    scales (speed does not depend on the values)."""
    import jax.numpy as jnp

    layout, block, fmt = _field_layout(kind)
    fields = {}
    for i, (name, width, dt) in enumerate(layout):
        shape = (*lead, n_out, width * (n_in // block))
        k = jax.random.fold_in(key, i)
        if dt == "float16":
            fields[name] = jax.random.uniform(k, shape, jnp.float32, 1e-3, 2e-3).astype(jnp.float16)
        else:
            hi = 64 if name in ("sub", "submin") else 127 if dt == "int8" else 256
            fields[name] = jax.random.randint(k, shape, 0, hi, jnp.int32).astype(dt)
    return QuantizedWeight(fields=fields, format=fmt, dtype=str(dtype))


def quantized_configs(name: str, dtype: str, scheme: str, tiny: bool = False):
    """:func:`configs` with the target's ``weight_formats`` set as ``scheme`` stores each layer
    (so the layer scans stack layers of one format)."""
    cfg, dcfg = configs(name, dtype, tiny)
    if not hasattr(cfg, "weight_formats"):
        return cfg, dcfg
    specs = module_for(dataclasses.replace(cfg, weight_formats=())).param_specs(cfg)
    n = cfg.num_hidden_layers
    per = []
    for i in range(n):
        key, _ = P.segment_slot(_segments(cfg), i)
        per.append(",".join(f"{leaf}={leaf_type(scheme, leaf, i, n, s.shape[-2])}" for leaf, s in sorted(specs[key].items())))
    return dataclasses.replace(cfg, weight_formats=tuple(per)), dcfg


def _segments(cfg):
    import importlib

    return importlib.import_module(module_for(cfg).module).segments(cfg)


def quantized_models(cfg, dcfg, scheme: str, seed: int = 0):
    """``(target params, drafter params)`` of :func:`random_models` with every leaf ``scheme``
    quantizes (:func:`leaf_type`) replaced by random codes of its format, made on the device leaf
    by leaf (``cfg`` from :func:`quantized_configs`)."""
    target, drafter = random_models(cfg, dcfg, seed)
    key = jax.random.key(seed + 1)
    starts = {f"seg{j}_{k}": start + k for j, (start, p, _) in enumerate(_segments(cfg)) for k in range(p)} if hasattr(cfg, "weight_formats") else {}

    def swap(tree, n_layers, drafter_side, layer_of):
        def one(path, a):
            if a.ndim < 2:
                return a
            names = [getattr(p, "key", None) for p in path]
            leaf = names[-1]
            table = leaf == "embed"
            n_in = a.shape[-1] if table else a.shape[-2]
            kind = leaf_type(scheme, leaf, layer_of(names), n_layers, n_in, drafter_side)
            if kind is None:
                return a
            k = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))
            lead, n_out = (a.shape[:-2], a.shape[-2]) if table else (a.shape[:-2], a.shape[-1])
            return random_quantized(k, kind, lead, n_in, n_out, str(a.dtype))

        return jax.tree_util.tree_map_with_path(one, tree)

    target = swap(target, cfg.num_hidden_layers, False, lambda names: starts.get(names[0]))
    drafter = swap(drafter, dcfg.num_hidden_layers, True, lambda names: 0)
    return target, drafter


def weight_memory(name: str, scheme: str = "", dtype: str = "bfloat16") -> tuple[int, int]:
    """``(target bytes, drafter bytes)`` of the device memory the weights of shape ``name`` take,
    float in ``dtype`` (``scheme`` ``""``) or quantized by ``scheme`` (:data:`SCHEMES`); computed
    from the shapes alone (``jax.eval_shape``: nothing is allocated). docs/models.md quotes these."""
    if scheme:
        cfg, dcfg = quantized_configs(name, dtype, scheme)
        trees = jax.eval_shape(lambda: quantized_models(cfg, dcfg, scheme))
    else:
        cfg, dcfg = configs(name, dtype)
        trees = jax.eval_shape(lambda: random_models(cfg, dcfg))
    return tree_bytes(trees[0]), tree_bytes(trees[1])
