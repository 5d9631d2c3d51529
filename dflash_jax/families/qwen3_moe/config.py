"""The static config of a Qwen3-MoE target (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B,
Qwen3-Coder-30B-A3B, Qwen3-235B-A22B) parsed from its HF ``config.json``.

Layer ``i`` has a sparse MoE block when it is not in ``mlp_only_layers``, ``num_experts > 0`` and
``(i + 1) % decoder_sparse_step == 0``; otherwise a dense SwiGLU of ``intermediate_size``. Source:
transformers ``configuration_qwen3_moe.py`` and ``Qwen3MoeDecoderLayer.__init__``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping
from dflash_jax.families.hf_config import RopeConfig, _get, _positive, parse_rope
from dflash_jax.errors import DFlashError


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """A Qwen3-MoE decoder in the terms of HF ``config.json``.

    Attention is Qwen3's (GQA, per-head ``q_norm``/``k_norm`` before RoPE, ``attention_bias``
    on q/k/v/o when set). ``sparse_layers[i]``: layer ``i`` runs the MoE block (``num_experts``
    experts of ``moe_intermediate_size``, ``num_experts_per_tok`` chosen by a softmax router,
    renormalised when ``norm_topk_prob``); otherwise the dense MLP of ``intermediate_size``.
    ``dtype``: compute and parameter dtype name.
    ``weight_formats``: per decoder layer, the storage formats of its weights when they are kept
    quantized (:func:`dflash_jax.formats.gguf_leaves.layer_formats`): only layers of equal formats
    stack into one layer scan; ``()`` for float weights.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    sparse_layers: tuple[bool, ...]
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    dtype: str = "float32"
    weight_formats: tuple = ()

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError("config: num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                              f"num_attention_heads={self.num_attention_heads}", "a divisor of num_attention_heads")
        if len(self.sparse_layers) != self.num_hidden_layers:
            raise DFlashError("config: sparse_layers", f"{len(self.sparse_layers)} entries", f"{self.num_hidden_layers} (one per layer)")
        if any(self.sparse_layers) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise DFlashError("config: num_experts_per_tok", f"got {self.num_experts_per_tok}", f"in [1, num_experts={self.num_experts}]")

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def with_dtype(self, dtype: str) -> "Qwen3MoeConfig":
        return dataclasses.replace(self, dtype=str(dtype))


def sparse_layer_flags(n_layers: int, num_experts: int, step: int, mlp_only: tuple[int, ...]) -> tuple[bool, ...]:
    """``sparse_layers`` from ``decoder_sparse_step`` and ``mlp_only_layers`` (transformers'
    ``Qwen3MoeDecoderLayer`` rule, module docstring)."""
    return tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))


def qwen3_moe_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> Qwen3MoeConfig:
    """Builds a :class:`Qwen3MoeConfig` from a parsed ``config.json``.

    ``num_experts`` may be written ``num_local_experts`` (transformers 5's ``save_pretrained``);
    ``head_dim`` falls back to ``hidden_size // num_attention_heads``; ``num_key_value_heads`` to
    ``num_attention_heads``; ``decoder_sparse_step`` to 1, ``mlp_only_layers`` to none.

    Raises:
      DFlashError: a required field missing or ill-typed, a non-positive size, a sliding window
        (``use_sliding_window`` true), or ``mlp_only_layers`` outside the layers; names ``source``
        and the field.
    """
    def pos(key, default=dataclasses.MISSING):
        return _positive(_get(cfg, key, source, int, default), key, source)

    hidden, heads, n_layers = pos("hidden_size"), pos("num_attention_heads"), pos("num_hidden_layers")
    head_dim = cfg.get("head_dim")
    if head_dim is None and hidden % heads:
        raise DFlashError(f"{source}: field head_dim", "missing and hidden_size is not divisible by num_attention_heads", "an explicit head_dim")
    head_dim = _positive(int(head_dim if head_dim is not None else hidden // heads), "head_dim", source)
    key_e = "num_local_experts" if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None else "num_experts"
    n_exp = _get(cfg, key_e, source, int)
    if n_exp < 0:
        raise DFlashError(f"{source}: field {key_e}", f"got {n_exp}", "a non-negative integer")
    mlp_only = _get(cfg, "mlp_only_layers", source, list, [])
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_layers for i in mlp_only):
        raise DFlashError(f"{source}: field mlp_only_layers", f"got {mlp_only!r}", f"layer ids in [0, {n_layers})")
    if cfg.get("use_sliding_window"):
        raise DFlashError(f"{source}: field use_sliding_window", "true (a window on some layers only)", "false")
    sparse = sparse_layer_flags(n_layers, n_exp, pos("decoder_sparse_step", 1), tuple(mlp_only))
    return Qwen3MoeConfig(
        vocab_size=pos("vocab_size"), hidden_size=hidden, intermediate_size=pos("intermediate_size"),
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=pos("num_key_value_heads", heads),
        head_dim=head_dim, num_experts=n_exp, num_experts_per_tok=pos("num_experts_per_tok") if any(sparse) else 0,
        moe_intermediate_size=pos("moe_intermediate_size") if any(sparse) else 0, sparse_layers=sparse,
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", source, bool, False)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", source, (int, float), 1e-6)), rope=parse_rope(cfg, source, head_dim),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=bool(cfg.get("attention_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 40960),
    )
