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

# HF ``architectures`` / ``model_type`` of the dense family -> its variant (``TargetConfig.family``)
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters of every family (HF ``rope_theta`` /
    ``rope_scaling`` / ``rope_parameters``); frequencies: :func:`dflash_jax.nn.rope.inv_frequencies`.

    ``kind``: ``"default"``, ``"linear"`` (positions divided by ``factor``), ``"llama3"``
    (Llama-3.1 frequency scaling: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``) or ``"yarn"`` (``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``truncate``; the cos/sin
    scale from ``attention_factor`` / ``mscale`` / ``mscale_all_dim``, see
    :func:`dflash_jax.nn.rope.yarn_scale`). ``partial``: the fraction of ``head_dim`` that rotates.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


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


DFLASH_DRAFTER = "DFlashDraftModel"
LAGUNA_DRAFTER = "DFlashLagunaForCausalLM"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (z-lab ``DFlashDraftModel``: Qwen3-style layers with KV injection).

    ``layer_causal[i]`` / ``layer_window[i]`` give each draft layer's attention inside the block:
    causal or bidirectional, and a sliding window over positions (0 = none).
    ``post_norm_last``: read the target's last layer after its final norm (transformers'
    ``hidden_states[L]``) instead of the pre-norm residual; only matters when the last layer is
    captured. Source: z-lab ``dflash/model.py`` (PyPI 0.1.0) and ``docs/specs/dflash.md`` section 1.

    ``architecture == "DFlashLagunaForCausalLM"`` (see :mod:`dflash_jax.models.laguna_drafter`):
    per-capture aux norms, context through each layer's input norm, and a softplus output gate
    ``gate`` = ``"head"`` or ``"element"`` (``gating_explicit``: named by the config, so a
    contradicting ``g_proj`` width is refused).

    ``draft_vocab_size``: 0 drafts over the target's whole vocabulary; ``Vd > 0`` over the
    ``Vd`` ids in the params' ``draft_ids`` (see :mod:`dflash_jax.draft_vocab`).

    ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping`` act on the target
    family's ``embed`` / ``lm_head`` outputs; a z-lab config's values (relative to the raw
    embedding and head) are restated so by :func:`dflash_jax.drafter_knobs.knobs_through_family`.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple
    num_target_layers: int
    layer_causal: tuple
    layer_window: tuple
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    post_norm_last: bool = False
    architecture: str = DFLASH_DRAFTER
    gate: str = ""
    gating_explicit: bool = False
    draft_vocab_size: int = 0
    dtype: str = "float32"

    def with_dtype(self, dtype: str) -> "DrafterConfig":
        return dataclasses.replace(self, dtype=str(dtype))


def _dflash_value(cfg: Mapping[str, Any], key: str, default=None, source: str = "config.json"):
    """A drafter field from ``dflash_config`` first, then the top level (z-lab ``_draft_value``).

    Raises:
      DFlashError: the field set in both places to different values (naming both).
    """
    sub = cfg.get("dflash_config") or {}
    top = cfg.get(key)
    if key in sub and sub[key] is not None:
        if top is not None and _normalized(top) != _normalized(sub[key]):
            raise DFlashError(f"{source}: field {key}", f"top level {top!r} contradicts dflash_config.{key} {sub[key]!r}",
                              "one value (set it in one place, or the same in both)")
        return sub[key]
    return default if top is None else top


def _normalized(value):
    return list(value) if isinstance(value, tuple) else value


def _need(cfg: Mapping[str, Any], key: str, types, source: str):
    """A required drafter field (``dflash_config`` first, then the top level) of ``types``."""
    value = _dflash_value(cfg, key, source=source)
    if value is None:
        raise DFlashError(f"{source}: field {key}", "missing (top level or dflash_config)", f"a value of type {_tname(types)}")
    if isinstance(value, bool) or not isinstance(value, types):
        raise DFlashError(f"{source}: field {key}", f"got {value!r}", _tname(types))
    return value


def _layer_ids(cfg: Mapping[str, Any], source: str) -> tuple:
    """``target_layer_ids``: a non-empty list of distinct layer indices."""
    layer_ids = _need(cfg, "target_layer_ids", (list, tuple), source)
    if not layer_ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
        raise DFlashError(f"{source}: field target_layer_ids", f"got {layer_ids!r}", "a non-empty list of layer indices")
    dup = sorted({i for i in layer_ids if list(layer_ids).count(i) > 1})
    if dup:
        raise DFlashError(f"{source}: field target_layer_ids", f"layer {dup[0]} listed more than once in {list(layer_ids)!r}", "distinct layer indices")
    return tuple(int(i) for i in layer_ids)


def _block_attention(cfg: Mapping[str, Any], source: str, n_layers: int) -> tuple[tuple, tuple]:
    """``(layer_causal, layer_window)`` from ``layer_types``, ``sliding_window`` and ``is_causal``."""
    layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise DFlashError(f"{source}: field layer_types", f"{len(layer_types)} entries", f"{n_layers} (num_hidden_layers)")
    is_causal = cfg.get("is_causal")  # top level only, as z-lab's Qwen3DFlashAttention reads it
    window = cfg.get("sliding_window")
    causal, windows = [], []
    for i, t in enumerate(layer_types):
        if t not in ("full_attention", "sliding_attention"):
            raise DFlashError(f"{source}: field layer_types[{i}]", f"got {t!r}", "full_attention or sliding_attention")
        sliding = t == "sliding_attention"
        if sliding and not window:
            raise DFlashError(f"{source}: field sliding_window", "missing for a sliding_attention layer", "a positive window")
        causal.append(sliding if is_causal is None else bool(is_causal))
        windows.append(int(window) if sliding else 0)
    return tuple(causal), tuple(windows)


def dflash_drafter_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
    """Builds a :class:`DrafterConfig` from a z-lab ``DFlashDraftModel`` ``config.json`` (the
    architecture is checked by :func:`dflash_jax.registry.drafter_config_from_hf`).

    ``block_size``, ``mask_token_id`` and ``target_layer_ids`` may sit at the top level or in
    ``dflash_config``; all three are required (no default layer ids are invented). Causality:
    a top-level ``is_causal`` overrides; otherwise sliding layers
    (``layer_types`` entry ``sliding_attention``) are causal and windowed by ``sliding_window``,
    full-attention layers are bidirectional.

    Raises:
      DFlashError: missing fields, ``layer_types`` of the wrong length, or a sliding layer
        without ``sliding_window``.
    """
    hidden = _positive(_get(cfg, "hidden_size", source, int), "hidden_size", source)
    heads = _positive(_get(cfg, "num_attention_heads", source, int), "num_attention_heads", source)
    kv_heads = _positive(_get(cfg, "num_key_value_heads", source, int, heads), "num_key_value_heads", source)
    head_dim = cfg.get("head_dim") or (hidden // heads)
    n_layers = _positive(_get(cfg, "num_hidden_layers", source, int), "num_hidden_layers", source)
    block_size = _need(cfg, "block_size", int, source)
    if block_size < 2:
        raise DFlashError(f"{source}: field block_size", f"got {block_size}", "an integer >= 2")
    mask_token_id = _need(cfg, "mask_token_id", int, source)
    layer_ids = _layer_ids(cfg, source)
    num_target_layers = _dflash_value(cfg, "num_target_layers", source=source)
    if num_target_layers is None:
        raise DFlashError(f"{source}: field num_target_layers", "missing", "the target's number of decoder layers")
    causal, windows = _block_attention(cfg, source, n_layers)
    softcap = _dflash_value(cfg, "final_logit_softcapping", source=source)
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=_positive(_get(cfg, "intermediate_size", source, int), "intermediate_size", source),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        vocab_size=_positive(_get(cfg, "vocab_size", source, int), "vocab_size", source),
        block_size=int(block_size),
        mask_token_id=int(mask_token_id),
        target_layer_ids=layer_ids,
        num_target_layers=int(num_target_layers),
        layer_causal=causal,
        layer_window=windows,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", source, (int, float), 1e-6)),
        rope=parse_rope(cfg, source, int(head_dim)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        input_embedding_scale=float(_dflash_value(cfg, "input_embedding_scale", 1.0, source)),
        output_multiplier=float(_dflash_value(cfg, "output_multiplier", 1.0, source)),
        final_logit_softcapping=float(softcap) if softcap else 0.0,
        post_norm_last=bool(_dflash_value(cfg, "post_norm_last", False, source)),
        architecture=DFLASH_DRAFTER,
    )


def check_drafter_fits(d: DrafterConfig, t: TargetConfig, source: str = "drafter") -> None:
    """Checks a drafter against its target; raises DFlashError naming the first mismatch.

    Checked: hidden size, vocab size, ``num_target_layers``, every captured layer id in
    ``[0, target layers)`` and ``mask_token_id`` a row of the target's embedding.
    """
    if d.hidden_size != t.hidden_size:
        raise DFlashError(f"{source}: field hidden_size", f"{d.hidden_size} differs from the target's", f"{t.hidden_size}")
    if d.vocab_size != t.vocab_size:
        raise DFlashError(f"{source}: field vocab_size", f"{d.vocab_size} differs from the target's", f"{t.vocab_size}")
    if d.num_target_layers != t.num_hidden_layers:
        raise DFlashError(f"{source}: field num_target_layers", f"{d.num_target_layers} differs from the target's", f"{t.num_hidden_layers}")
    for i in d.target_layer_ids:
        if not 0 <= i < t.num_hidden_layers:
            raise DFlashError(f"{source}: field target_layer_ids", f"layer id {i} out of range", f"ids in [0, {t.num_hidden_layers})")
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise DFlashError(f"{source}: field mask_token_id", f"{d.mask_token_id} is not a row of the target embedding", f"an id in [0, {t.vocab_size})")
    max_block = getattr(t, "max_block", None)
    if max_block is not None and d.block_size > max_block:
        raise DFlashError(f"{source}: field block_size", f"{d.block_size} exceeds the target cache's max_block",
                          f"at most {max_block} (the sliding-window ring holds window + max_block rows)")
