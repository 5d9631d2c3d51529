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

``TINY`` holds the same kinds at toy sizes for ``--dry-run`` on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import model as drafter_mod
from dflash_jax.nn import params as P
from dflash_jax.nn import quant, quant_fp8
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
    mixture of experts, only the experts the rows can choose (``min(E, batch * top_k)``)."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path[-1:]).strip("[]'\"")
        n = int(x.size) * x.dtype.itemsize
        if name == "embed" and "lm_head" in params:
            n = batch * n // x.shape[0]
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
