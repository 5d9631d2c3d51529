"""The static config of a gpt-oss target (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b) parsed
from its HF ``config.json``. Source: transformers ``configuration_gpt_oss.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping
from dflash_jax.families.hf_config import RopeConfig, _get, _positive, rope_from_parameters
from dflash_jax.errors import DFlashError


LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """A gpt-oss decoder in the terms of HF ``config.json``.

    Every layer: GQA attention with q/k/v/o biases, a learned per-head attention sink, RoPE
    (YaRN); ``layer_types[i]`` ``"sliding_attention"`` layers see keys less than
    ``sliding_window`` positions back. Every layer's MLP is a MoE: a biased router, the top
    ``num_experts_per_tok`` logits softmaxed, experts of width ``intermediate_size`` with biases
    and the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``).
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
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: RopeConfig = RopeConfig()
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    dtype: str = "float32"
    weight_formats: tuple = ()

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError("config: num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                              f"num_attention_heads={self.num_attention_heads}", "a divisor of num_attention_heads")
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise DFlashError("config: layer_types", f"got {self.layer_types!r}", f"{self.num_hidden_layers} of {LAYER_TYPES}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise DFlashError("config: num_experts_per_tok", f"got {self.num_experts_per_tok}", f"in [1, num_experts={self.num_experts}]")

    def with_dtype(self, dtype: str) -> "GptOssConfig":
        return dataclasses.replace(self, dtype=str(dtype))


def _rope(cfg: Mapping[str, Any], source: str) -> RopeConfig:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` plus ``rope_theta`` (the published
    config); YaRN's ``truncate`` defaults to true as in transformers."""
    sub = cfg.get("rope_parameters")
    where = f"{source}: field rope_parameters"
    if not sub:
        sub = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 150000.0))
        where = f"{source}: field rope_scaling"
    if not isinstance(sub, Mapping):
        raise DFlashError(where, f"got {sub!r}", "a rope parameter object")
    truncate = sub.get("truncate", True)
    if not isinstance(truncate, bool):
        raise DFlashError(f"{where}: field truncate", f"got {truncate!r}", "true or false")
    return rope_from_parameters(sub, where, truncate)


def gpt_oss_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> GptOssConfig:
    """Builds a :class:`GptOssConfig` from a parsed ``config.json``.

    ``num_local_experts`` may be written ``num_experts``; ``layer_types`` defaults to sliding on
    even layers and full on odd ones (transformers' rule); ``head_dim`` to ``hidden_size //
    num_attention_heads``.

    Raises:
      DFlashError: a required field missing or ill-typed, a non-positive size, ``layer_types`` of
        the wrong length or values, ``attention_bias`` false, or an unsupported rope (names
        ``source`` and the field).
    """
    def pos(key, default=dataclasses.MISSING):
        return _positive(_get(cfg, key, source, int, default), key, source)

    hidden, heads, n = pos("hidden_size"), pos("num_attention_heads"), pos("num_hidden_layers")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise DFlashError(f"{source}: field layer_types", f"got {types!r}", f"a list of {n} entries from {LAYER_TYPES}")
    if cfg.get("attention_bias", True) is not True:
        raise DFlashError(f"{source}: field attention_bias", f"got {cfg.get('attention_bias')!r}", "true (gpt-oss attention has biases)")
    key_e = "num_experts" if cfg.get("num_local_experts") is None and cfg.get("num_experts") is not None else "num_local_experts"
    window = pos("sliding_window") if "sliding_attention" in types else int(cfg.get("sliding_window") or 0)
    head_dim = pos("head_dim", hidden // heads)
    return GptOssConfig(
        vocab_size=pos("vocab_size"), hidden_size=hidden, intermediate_size=pos("intermediate_size"), num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=pos("num_key_value_heads", heads), head_dim=head_dim,
        num_experts=pos(key_e), num_experts_per_tok=pos("num_experts_per_tok"), layer_types=tuple(types), sliding_window=window,
        rope=_rope(cfg, source), rms_norm_eps=float(_get(cfg, "rms_norm_eps", source, (int, float), 1e-5)),
        swiglu_limit=float(_get(cfg, "swiglu_limit", source, (int, float), 7.0)),
        swiglu_alpha=float(_get(cfg, "swiglu_alpha", source, (int, float), 1.702)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 131072),
    )
