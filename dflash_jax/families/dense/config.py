"""The static config of a dense target (:class:`TargetConfig`: Llama incl. SmolLM2, Mistral, Qwen2,
Qwen3) parsed and validated from its HF ``config.json``.

Configs are frozen dataclasses: they are passed to jitted functions as static arguments, so two
equal configs share one compilation. Parsing is strict: a missing or ill-typed field raises
:class:`~dflash_jax.errors.DFlashError` naming the file and field; nothing is guessed silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dflash_jax.errors import DFlashError
from dflash_jax.families.hf_config import RopeConfig, _get, _positive, parse_rope

FAMILIES = ("llama", "qwen2", "qwen3")

# HF ``architectures`` / ``model_type`` of the dense family -> its variant (``TargetConfig.family``)
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A dense decoder (Llama, Qwen2, Qwen3) in the terms of HF ``config.json``.

    ``qkv_bias``: q/k/v projections carry a bias (Qwen2; Llama/Qwen3 with ``attention_bias``).
    ``o_bias``: the output projection carries a bias (Llama/Qwen3 ``attention_bias``).
    ``qk_norm``: per-head RMSNorm on q and k before RoPE (Qwen3).
    ``sliding_window``: every layer attends keys less than this many positions back (Mistral's
    ``sliding_window``; 0 = no window).
    ``dtype``: the compute and parameter dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise DFlashError("config: family", f"unsupported value {self.family!r}", f"one of {FAMILIES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError(
                "config: num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
                "a divisor of num_attention_heads",
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def with_dtype(self, dtype: str) -> "TargetConfig":
        return dataclasses.replace(self, dtype=str(dtype))


def target_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> TargetConfig:
    """Builds a :class:`TargetConfig` from a parsed HF ``config.json``.

    The variant (llama, qwen2, qwen3) comes from ``architectures`` (or ``model_type``). ``head_dim`` falls back to
    ``hidden_size // num_attention_heads`` when absent (the transformers rule);
    ``num_key_value_heads`` falls back to ``num_attention_heads``.

    Raises:
      DFlashError: unknown architecture, or a required field missing or of the wrong type;
        the message names ``source`` and the field.
    """
    archs = cfg.get("architectures") or []
    family = None
    for arch in archs:
        family = HF_ARCHITECTURES.get(arch, family)
    if family is None:
        family = HF_MODEL_TYPES.get(cfg.get("model_type"))
    if family is None:
        raise DFlashError(f"{source}: field architectures", f"unsupported model {archs or cfg.get('model_type')!r}", f"one of {sorted(HF_ARCHITECTURES)}")
    hidden = _positive(_get(cfg, "hidden_size", source, int), "hidden_size", source)
    heads = _positive(_get(cfg, "num_attention_heads", source, int), "num_attention_heads", source)
    kv_heads = _positive(_get(cfg, "num_key_value_heads", source, int, heads), "num_key_value_heads", source)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise DFlashError(f"{source}: field head_dim", "missing and hidden_size is not divisible by num_attention_heads", "an explicit head_dim")
        head_dim = hidden // heads
    head_dim = _positive(int(head_dim), "head_dim", source)
    attention_bias = bool(cfg.get("attention_bias", False))
    window = _sliding_window(cfg, source, family)
    return TargetConfig(
        family=family,
        vocab_size=_positive(_get(cfg, "vocab_size", source, int), "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_positive(_get(cfg, "intermediate_size", source, int), "intermediate_size", source),
        num_hidden_layers=_positive(_get(cfg, "num_hidden_layers", source, int), "num_hidden_layers", source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", source, (int, float), 1e-6)),
        rope=parse_rope(cfg, source, head_dim),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        sliding_window=window,
    )


def _sliding_window(cfg: Mapping[str, Any], source: str, family: str) -> int:
    """Mistral's ``sliding_window`` (0 when null or absent); Qwen2/Qwen3 configs with
    ``use_sliding_window`` true are refused (their window covers only layers from
    ``max_window_layers`` on, which the dense family does not model).

    Raises:
      DFlashError: a non-positive or non-integer window, or ``use_sliding_window`` true.
    """
    if family in ("qwen2", "qwen3"):
        if cfg.get("use_sliding_window"):
            raise DFlashError(f"{source}: field use_sliding_window", "true (a window on some layers only)", "false")
        return 0
    if cfg.get("model_type") != "mistral" and "MistralForCausalLM" not in (cfg.get("architectures") or []):
        return 0
    window = _get(cfg, "sliding_window", source, int, 0)
    return 0 if window == 0 else _positive(window, "sliding_window", source)
