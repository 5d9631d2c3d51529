"""Static, hashable configuration of the poolside Laguna target (``LagunaForCausalLM``).

Parsed strictly from HF ``config.json`` (transformers 5.24 ``LagunaConfig`` defaults and rules;
``docs/specs/laguna.md`` sections 2 and 9). Every problem raises
:class:`~dflash_jax.errors.DFlashError` naming the file and the field.

Rules taken from transformers ``configuration_laguna.py`` / ``modeling_laguna.py``:

* ``num_attention_heads_per_layer`` (default ``[num_attention_heads] * L``), ``layer_types``
  (default all ``full_attention``), ``mlp_layer_types`` (default ``dense`` then ``sparse``).
* ``head_dim`` defaults to 128 (never ``hidden_size // heads``).
* ``rope_parameters`` nested by layer type; when absent: full ``{default, theta 5e5,
  partial 0.5}``, sliding ``{default, theta 1e4, partial 1.0}``. A flat dict applies to every
  layer type. Inside a sub-dict a missing ``partial_rotary_factor`` means 1.0.
* YaRN ``truncate`` is read from the *top level* of ``rope_parameters`` (transformers'
  ``_compute_yarn_parameters`` does ``config.rope_parameters.get("truncate", True)``, so a
  ``truncate`` inside a per-layer-type sub-dict is ignored there); default True.
* ``gating``: ``True``/missing/``"per-head"`` -> one gate per head in transformers; the loaders
  trust the ``g_proj`` width when ``gating`` is ``True`` or missing (poolside's remote code reads
  it as per-element) and refuse an explicit string that contradicts it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping
from dflash_jax.families.hf_config import RopeConfig, _get, rope_from_parameters
from dflash_jax.errors import DFlashError


LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")
ATTENTION_FACTOR_RULES = ("transformers", "derived")


@dataclasses.dataclass(frozen=True)
class LagunaConfig:
    """A Laguna decoder (XS.2, XS-2.1, S-2.1, M.1) in the terms of HF ``config.json``.

    Per-layer tuples (length ``num_hidden_layers``): ``heads_per_layer`` (query heads),
    ``layer_types`` (``full_attention`` / ``sliding_attention``), ``mlp_layer_types``
    (``dense`` / ``sparse``), ``gate_per_head`` (True: ``g_proj`` is ``[nh, H]``; False:
    ``[nh * head_dim, H]``).

    ``gating_explicit``: the config named the gate kind with a string (a ``g_proj`` width that
    contradicts it is an error); otherwise loaders may correct ``gate_per_head`` from the weights.
    ``attention_factor_rule``: ``"transformers"`` (the config's YaRN ``attention_factor`` if
    given, else ``0.1 ln(factor) + 1``) or ``"derived"`` (always ``0.1 ln(factor) + 1``, as vLLM).
    Either way the scale multiplies cos and sin of the YaRN layers exactly once.
    ``max_block``: the most tokens one forward may write past the committed length (the
    speculative block width); sliding layers keep ``sliding_window + max_block`` cache rows.
    ``router_score``: ``"sigmoid"`` (released models) or ``"sqrtsoftplus"``.
    ``weight_formats``: per decoder layer, the storage formats of its weights when they are kept
    quantized (:func:`dflash_jax.formats.gguf_leaves.layer_formats`): only layers of equal formats
    stack into one layer scan; ``()`` for float weights.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    heads_per_layer: tuple
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple
    mlp_layer_types: tuple
    gate_per_head: tuple
    rope_full: RopeConfig
    rope_sliding: RopeConfig
    sliding_window: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    routed_scaling_factor: float = 1.0
    router_softcap: float = 0.0
    router_score: str = "sigmoid"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    gating_explicit: bool = False
    attention_factor_rule: str = "transformers"
    max_block: int = 16
    dtype: str = "float32"
    weight_formats: tuple = ()

    def __post_init__(self):
        n = self.num_hidden_layers
        for name in ("heads_per_layer", "layer_types", "mlp_layer_types", "gate_per_head"):
            if len(getattr(self, name)) != n:
                raise DFlashError(f"config: {name}", f"{len(getattr(self, name))} entries", f"{n} (num_hidden_layers)")
        for i, h in enumerate(self.heads_per_layer):
            if h % self.num_key_value_heads:
                raise DFlashError(f"config: num_attention_heads_per_layer[{i}]", f"{h} is not a multiple of num_key_value_heads={self.num_key_value_heads}",
                                  "a multiple of num_key_value_heads")
        if self.attention_factor_rule not in ATTENTION_FACTOR_RULES:
            raise DFlashError("config: attention_factor_rule", f"got {self.attention_factor_rule!r}", f"one of {ATTENTION_FACTOR_RULES}")
        if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
            raise DFlashError("config: sliding_window", f"got {self.sliding_window}", "a positive window for sliding_attention layers")

    @property
    def family(self) -> str:
        return "laguna"

    @property
    def num_attention_heads(self) -> int:
        """The largest per-layer query-head count (for sizing only; layers differ)."""
        return max(self.heads_per_layer)

    @property
    def ring_size(self) -> int:
        """Rows of a sliding layer's KV ring: ``sliding_window + max_block``."""
        return self.sliding_window + self.max_block

    def gate_width(self, layer: int) -> int:
        return self.heads_per_layer[layer] * (1 if self.gate_per_head[layer] else self.head_dim)

    def with_dtype(self, dtype: str) -> "LagunaConfig":
        return dataclasses.replace(self, dtype=str(dtype))


def _num(cfg: Mapping[str, Any], key: str, where: str, types, default=dataclasses.MISSING):
    """A typed field (bools refused), as :func:`dflash_jax.families.hf_config._get`."""
    return _get(cfg, key, where, types, default)

def _pos_int(cfg, key, where, default=dataclasses.MISSING) -> int:
    v = _num(cfg, key, where, (int,), default)
    if v <= 0:
        raise DFlashError(f"{where}: field {key}", f"got {v}", "a positive integer")
    return int(v)


def _layer_list(cfg, key, where, n, allowed, default):
    v = cfg.get(key)
    if v is None:
        return tuple(default)
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise DFlashError(f"{where}: field {key}", f"got {v!r}", f"a list of {n} entries (num_hidden_layers)")
    for i, t in enumerate(v):
        if t not in allowed:
            raise DFlashError(f"{where}: field {key}[{i}]", f"got {t!r}", f"one of {allowed}")
    return tuple(v)


def parse_gating(value, where: str) -> tuple[bool, bool]:
    """``gating`` -> ``(per_head, explicit)``.

    ``True`` or missing -> per-head, not explicit (the ``g_proj`` width decides at load time);
    ``"per-head"``/``"per_head"`` -> per-head; ``"per-element"``/``"per_element"`` -> per-element.

    Raises:
      DFlashError: any other value (``False`` included: an ungated Laguna is not a published model).
    """
    if value is None or value is True:
        return True, False
    if value in ("per-head", "per_head"):
        return True, True
    if value in ("per-element", "per_element"):
        return False, True
    raise DFlashError(f"{where}: field gating", f"got {value!r}", "true, \"per-head\" or \"per-element\"")


def _gates(cfg: Mapping[str, Any], where: str, n: int) -> tuple[tuple, bool]:
    """``(gate_per_head per layer, explicit)`` from ``gating`` and poolside's ``gating_types``."""
    per_head, explicit = parse_gating(cfg.get("gating", True), where)
    gt = cfg.get("gating_types")
    if gt is None:
        return (per_head,) * n, explicit
    # poolside remote-code per-layer list ("per_head" / "per_element")
    if not isinstance(gt, (list, tuple)) or len(gt) != n:
        raise DFlashError(f"{where}: field gating_types", f"got {gt!r}", f"a list of {n} entries")
    gate = tuple(parse_gating(g, f"{where}: gating_types[{i}]")[0] for i, g in enumerate(gt))
    if cfg.get("gating") not in (None, True) and any(g != per_head for g in gate):
        raise DFlashError(f"{where}: field gating_types", f"contradicts gating={cfg.get('gating')!r}", "the same gate kind")
    return gate, True


def _ropes(cfg: Mapping[str, Any], where: str, layer_types: tuple) -> tuple[RopeConfig, RopeConfig]:
    """``(full-attention rope, sliding-attention rope)`` from ``rope_parameters`` (module docstring)."""
    rp = cfg.get("rope_parameters")
    if rp is None:
        return RopeConfig(theta=500000.0, partial=0.5), RopeConfig(theta=10000.0, partial=1.0)
    if not isinstance(rp, Mapping):
        raise DFlashError(f"{where}: field rope_parameters", f"got {rp!r}", "an object")
    truncate = bool(rp.get("truncate", True))
    if "full_attention" not in rp and "sliding_attention" not in rp:
        rope = rope_from_parameters(rp, f"{where}: field rope_parameters", truncate)
        return rope, rope
    for t in set(layer_types):
        if t not in rp:
            raise DFlashError(f"{where}: field rope_parameters.{t}", "missing for a layer of that type", "a rope parameter object")
    subs = {t: rope_from_parameters(rp[t], f"{where}: field rope_parameters.{t}", truncate) if t in rp else None for t in LAYER_TYPES}
    return subs["full_attention"] or subs["sliding_attention"], subs["sliding_attention"] or subs["full_attention"]


def _refuse_unsupported(cfg: Mapping[str, Any], where: str) -> str:
    """Refuses the options no published Laguna uses; returns the router score function."""
    if cfg.get("moe_apply_router_weight_on_input"):
        raise DFlashError(f"{where}: field moe_apply_router_weight_on_input", "true is not supported", "false")
    if cfg.get("attention_bias"):
        raise DFlashError(f"{where}: field attention_bias", "true is not supported", "false")
    score = cfg.get("moe_router_score_func", "sigmoid") or "sigmoid"
    if score not in ("sigmoid", "sqrtsoftplus"):
        raise DFlashError(f"{where}: field moe_router_score_func", f"got {score!r}", "sigmoid or sqrtsoftplus")
    return score


def laguna_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> LagunaConfig:
    """Builds a :class:`LagunaConfig` from a parsed Laguna ``config.json``.

    Raises:
      DFlashError: a missing or ill-typed field, per-layer lists of the wrong length or with
        unknown entries, an unsupported ``rope_type`` / router score function, or
        ``moe_apply_router_weight_on_input`` / ``attention_bias`` true (not implemented in
        transformers either / absent from every published model). Messages name ``source`` and
        the field.
    """
    where = source
    n = _pos_int(cfg, "num_hidden_layers", where, 40)
    heads = _pos_int(cfg, "num_attention_heads", where, 48)
    hpl = cfg.get("num_attention_heads_per_layer")
    if hpl is None:
        hpl = [heads] * n
    if not isinstance(hpl, (list, tuple)) or len(hpl) != n or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hpl):
        raise DFlashError(f"{where}: field num_attention_heads_per_layer", f"got {hpl!r}", f"{n} positive integers (num_hidden_layers)")
    layer_types = _layer_list(cfg, "layer_types", where, n, LAYER_TYPES, ["full_attention"] * n)
    mlp_types = _layer_list(cfg, "mlp_layer_types", where, n, MLP_TYPES, ["dense"] + ["sparse"] * (n - 1))
    gate, explicit = _gates(cfg, where, n)
    score = _refuse_unsupported(cfg, where)
    rope_full, rope_sliding = _ropes(cfg, where, layer_types)
    window = cfg.get("sliding_window") or 0
    if "sliding_attention" in layer_types:
        window = _pos_int(cfg, "sliding_window", where)
    return LagunaConfig(
        vocab_size=_pos_int(cfg, "vocab_size", where, 100352),
        hidden_size=_pos_int(cfg, "hidden_size", where, 2048),
        intermediate_size=_pos_int(cfg, "intermediate_size", where, 8192),
        num_hidden_layers=n,
        heads_per_layer=tuple(int(h) for h in hpl),
        num_key_value_heads=_pos_int(cfg, "num_key_value_heads", where, 8),
        head_dim=_pos_int(cfg, "head_dim", where, 128),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        gate_per_head=gate,
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        sliding_window=int(window),
        num_experts=_pos_int(cfg, "num_experts", where, 256),
        num_experts_per_tok=_pos_int(cfg, "num_experts_per_tok", where, 8),
        moe_intermediate_size=_pos_int(cfg, "moe_intermediate_size", where, 512),
        shared_expert_intermediate_size=_pos_int(cfg, "shared_expert_intermediate_size", where, 512),
        routed_scaling_factor=float(_num(cfg, "moe_routed_scaling_factor", where, (int, float), 1.0)),
        router_softcap=float(_num(cfg, "moe_router_logit_softcapping", where, (int, float), 0.0)),
        router_score=score,
        rms_norm_eps=float(_num(cfg, "rms_norm_eps", where, (int, float), 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=_pos_int(cfg, "max_position_embeddings", where, 131072),
        gating_explicit=explicit,
    )
