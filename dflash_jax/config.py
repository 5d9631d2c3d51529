"""Static, hashable model configurations parsed and validated from HF ``config.json`` dicts.

Configs are frozen dataclasses: they are passed to jitted functions as static arguments, so two
equal configs share one compilation. Parsing is strict: a missing or ill-typed field raises
:class:`~dflash_jax.errors.DFlashError` naming the file and field; nothing is guessed silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from dflash_jax.errors import DFlashError

FAMILIES = ("llama", "qwen2", "qwen3")

_ARCH_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (HF ``rope_theta`` / ``rope_scaling``).

    ``kind`` is ``"default"``, ``"linear"`` or ``"llama3"`` (Llama-3.1 frequency scaling);
    ``partial`` is the fraction of ``head_dim`` that rotates (1.0 for all dense families).
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial: float = 1.0


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A dense decoder (Llama, Qwen2, Qwen3) in the terms of HF ``config.json``.

    ``qkv_bias``: q/k/v projections carry a bias (Qwen2; Llama/Qwen3 with ``attention_bias``).
    ``o_bias``: the output projection carries a bias (Llama/Qwen3 ``attention_bias``).
    ``qk_norm``: per-head RMSNorm on q and k before RoPE (Qwen3).
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


def _get(cfg: Mapping[str, Any], key: str, source: str, types, default=dataclasses.MISSING):
    if key not in cfg or cfg[key] is None:
        if default is dataclasses.MISSING:
            raise DFlashError(f"{source}: field {key}", "missing", f"a value of type {_tname(types)}")
        return default
    value = cfg[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise DFlashError(f"{source}: field {key}", f"got {value!r}", _tname(types))
    if not isinstance(value, types):
        raise DFlashError(f"{source}: field {key}", f"got {value!r}", _tname(types))
    return value


def _tname(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in types)


def _positive(value: int, key: str, source: str) -> int:
    if value <= 0:
        raise DFlashError(f"{source}: field {key}", f"got {value}", "a positive integer")
    return value


def parse_rope(cfg: Mapping[str, Any], source: str, head_dim: int) -> RopeConfig:
    """Reads ``rope_theta``, ``rope_scaling`` (or ``rope_parameters``) and ``partial_rotary_factor``.

    Raises:
      DFlashError: an unsupported ``rope_type`` or a scaling dict missing its fields.
    """
    scaling = cfg.get("rope_scaling") or None
    params = cfg.get("rope_parameters") or None
    theta = cfg.get("rope_theta")
    if params is not None and isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = params
    theta = float(theta if theta is not None else 10000.0)
    partial = float(cfg.get("partial_rotary_factor") or 1.0)
    if scaling is None:
        return RopeConfig(theta=theta, partial=partial)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    where = f"{source}: field rope_scaling"
    if kind == "default":
        return RopeConfig(theta=theta, partial=partial)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(_get(scaling, "factor", where, (int, float))), partial=partial)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(_get(scaling, "factor", where, (int, float))),
            low_freq_factor=float(_get(scaling, "low_freq_factor", where, (int, float))),
            high_freq_factor=float(_get(scaling, "high_freq_factor", where, (int, float))),
            original_max_position_embeddings=int(_get(scaling, "original_max_position_embeddings", where, int)),
            partial=partial,
        )
    raise DFlashError(where, f"unsupported rope_type {kind!r}", "default, linear or llama3")


def target_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> TargetConfig:
    """Builds a :class:`TargetConfig` from a parsed HF ``config.json``.

    The family comes from ``architectures`` (or ``model_type``). ``head_dim`` falls back to
    ``hidden_size // num_attention_heads`` when absent (the transformers rule);
    ``num_key_value_heads`` falls back to ``num_attention_heads``.

    Raises:
      DFlashError: unknown architecture, or a required field missing or of the wrong type;
        the message names ``source`` and the field.
    """
    archs = cfg.get("architectures") or []
    family = None
    for arch in archs:
        family = _ARCH_TO_FAMILY.get(arch, family)
    if family is None:
        family = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(cfg.get("model_type"))
    if family is None:
        raise DFlashError(
            f"{source}: field architectures",
            f"unsupported model {archs or cfg.get('model_type')!r}",
            f"one of {sorted(_ARCH_TO_FAMILY)}",
        )
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
    )


def read_json(path: str | os.PathLike) -> dict:
    """Reads a JSON file; raises DFlashError naming the file when it is missing or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DFlashError(str(path), "file not found", "an existing JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DFlashError(str(path), f"not valid JSON ({e})", "a JSON object") from None
    if not isinstance(data, dict):
        raise DFlashError(str(path), f"top level is {type(data).__name__}", "a JSON object")
    return data
