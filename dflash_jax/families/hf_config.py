"""What every family's config parser shares: :class:`RopeConfig` and :func:`parse_rope`, the strict
field readers (``_get``, ``_positive``), :func:`rope_from_parameters` and :func:`read_json`.

Configs are frozen dataclasses: they are passed to jitted functions as static arguments, so two
equal configs share one compilation. Parsing is strict: a missing or ill-typed field raises
:class:`~dflash_jax.errors.DFlashError` naming the file and field; nothing is guessed silently.

The dimension fields the targets share, by the same names: every family's config has
``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers`` (no default),
``rms_norm_eps``, ``tie_word_embeddings``, ``max_position_embeddings`` and ``dtype``; all but
Laguna (per-layer query heads: a property) have ``num_attention_heads``, all but Gemma 4 (per
layer type) ``num_key_value_heads`` and ``head_dim`` (what the plain KV cache of
:class:`~dflash_jax.families.contract.FamilyModel` reads). They are not one base class: the
defaults differ (``rms_norm_eps`` 1e-5 in gpt-oss, ``tie_word_embeddings`` true in Gemma 4,
``max_position_embeddings`` per family) and a dataclass base puts its fields first, which would
reorder each config's fields (positional construction, ``repr`` and ``dataclasses.asdict``, which
the GGUF weight cache's ``meta.json`` and compiled-executable keys read) for no gain in behaviour.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from dflash_jax.errors import DFlashError


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters of every family (HF ``rope_theta`` /
    ``rope_scaling`` / ``rope_parameters``); frequencies: :func:`dflash_jax.nn.layer.inv_frequencies`.

    ``kind``: ``"default"``, ``"linear"`` (positions divided by ``factor``), ``"llama3"``
    (Llama-3.1 frequency scaling: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``) or ``"yarn"`` (``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``truncate``; the cos/sin
    scale from ``attention_factor`` / ``mscale`` / ``mscale_all_dim``, see
    :func:`dflash_jax.nn.layer.yarn_scale`). ``partial``: the fraction of ``head_dim`` that rotates.
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


def rope_from_parameters(sub: Mapping[str, Any], where: str, truncate: bool) -> RopeConfig:
    """A :class:`RopeConfig` from one ``rope_parameters`` object (``rope_type`` default or yarn,
    ``rope_theta``, ``partial_rotary_factor``, YaRN's ``factor``, ``original_max_position_embeddings``,
    ``beta_fast``/``beta_slow``, ``attention_factor``/``mscale``/``mscale_all_dim``): Laguna's
    and gpt-oss's. Raises DFlashError naming ``where`` and the field."""
    if not isinstance(sub, Mapping):
        raise DFlashError(where, f"got {sub!r}", "a rope parameter object")
    kind = sub.get("rope_type", sub.get("type", "default"))
    theta = float(_get(sub, "rope_theta", where, (int, float)))
    partial = float(_get(sub, "partial_rotary_factor", where, (int, float), 1.0))
    if not 0 < partial <= 1:
        raise DFlashError(f"{where}: field partial_rotary_factor", f"got {partial}", "a value in (0, 1]")
    if kind == "default":
        return RopeConfig(theta=theta, partial=partial)
    if kind != "yarn":
        raise DFlashError(f"{where}: field rope_type", f"unsupported value {kind!r}", "default or yarn")
    opt = lambda k: None if sub.get(k) is None else float(_get(sub, k, where, (int, float)))  # noqa: E731
    return RopeConfig(
        theta=theta, partial=partial, kind="yarn",
        factor=float(_get(sub, "factor", where, (int, float))),
        original_max_position_embeddings=_positive(_get(sub, "original_max_position_embeddings", where, (int,)),
                                                   "original_max_position_embeddings", where),
        beta_fast=float(sub.get("beta_fast") or 32), beta_slow=float(sub.get("beta_slow") or 1),
        attention_factor=opt("attention_factor"), mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        truncate=truncate,
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
