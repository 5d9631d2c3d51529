"""The static config of a Gemma 4 text target (``Gemma4ForCausalLM``, ``model_type`` ``gemma4_text``)
parsed from its HF ``config.json``.

Sliding and full (global) attention layers (``layer_types``) each have their own head size and
key/value head count (``head_dim`` / ``num_key_value_heads`` for sliding layers, a full layer's
from its ``per_layer_config`` entry, else ``global_head_dim``), and their own RoPE
(``rope_parameters[layer type]``: ``default`` or ``proportional``, the latter rotating only the
first ``partial_rotary_factor`` of each head's frequencies). Source: transformers
``configuration_gemma4.py`` ``Gemma4TextConfig`` and ``modeling_rope_utils.py``
``_compute_proportional_rope_parameters``. What is refused: :func:`gemma4_config_from_hf`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping
from dflash_jax.families.hf_config import _get, _positive
from dflash_jax.errors import DFlashError


LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """A Gemma 4 text decoder in the terms of HF ``config.json``.

    ``head_dims`` / ``kv_heads`` / ``ropes``: per layer type, in :data:`LAYER_TYPES` order
    (sliding, full); a rope is ``(rope_type, rope_theta, partial_rotary_factor, factor)``.
    ``per_layer_input``: ``hidden_size_per_layer_input`` (0: no per-layer embeddings), with
    ``per_layer_vocab`` rows. ``final_logit_softcapping``: 0 for none. The last
    ``num_kv_shared_layers`` layers compute no keys or values: each attends those of the last
    earlier layer of its type (transformers' ``kv_sharing_modes`` "reuse" / "store"), and with
    ``use_double_wide_mlp`` has an MLP twice ``intermediate_size`` wide. ``attention_k_eq_v``:
    full layers have no value projection, their values are the key projection's output (before
    the key norm and RoPE) under the value norm. ``num_experts`` > 0 (``enable_moe_block``): every
    layer runs ``num_experts`` routed experts of width ``moe_intermediate_size`` (``top_k_experts``
    per token) beside its dense MLP. ``dtype``: compute and parameter dtype name.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, int]
    kv_heads: tuple[int, int]
    ropes: tuple[tuple[str, float, float, float], tuple[str, float, float, float]]
    sliding_window: int
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    final_logit_softcapping: float = 0.0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    attention_k_eq_v: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    dtype: str = "float32"

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise DFlashError("config: layer_types", f"{self.layer_types!r}", f"{self.num_hidden_layers} entries of {LAYER_TYPES}")
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if self.num_kv_shared_layers and {t for t in self.layer_types[:first]} != set(self.layer_types):
            raise DFlashError("config: num_kv_shared_layers", f"{self.num_kv_shared_layers} shared layers, whose types "
                              f"{sorted(set(self.layer_types[first:]))} not all computed by an earlier layer",
                              "an earlier layer of every shared layer's type")
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise DFlashError("config: top_k_experts", f"{self.top_k_experts}", f"in [1, num_experts={self.num_experts}]")
        for kv in self.kv_heads:
            if self.num_attention_heads % kv:
                raise DFlashError("config: num_key_value_heads", f"{kv} does not divide num_attention_heads="
                                  f"{self.num_attention_heads}", "a divisor of num_attention_heads")

    def kind(self, layer: int) -> int:
        """0 for a sliding layer, 1 for a full one (index into ``head_dims``, ``kv_heads``, ``ropes``)."""
        return LAYER_TYPES.index(self.layer_types[layer])

    def shares_kv(self, layer: int) -> bool:
        """Whether the layer reuses an earlier layer's keys and values (computes none)."""
        return layer >= self.num_hidden_layers - self.num_kv_shared_layers

    def count(self, kind: int) -> int:
        """The number of layers of type ``kind`` that compute keys and values (rows of its KV stack)."""
        return sum(t == LAYER_TYPES[kind] and not self.shares_kv(i) for i, t in enumerate(self.layer_types))

    def kv_row(self, layer: int) -> int:
        """The layer's row of its type's KV stack: its own, or (KV sharing) the last earlier
        computing layer's of its type."""
        if self.shares_kv(layer):
            return self.count(self.kind(layer)) - 1
        return sum(t == self.layer_types[layer] for t in self.layer_types[:layer])

    def k_eq_v(self, layer: int) -> bool:
        """Whether the layer's values are its keys' projection (``attention_k_eq_v``, full layers only)."""
        return self.attention_k_eq_v and self.kind(layer) == 1

    def mlp_size(self, layer: int) -> int:
        """The layer's MLP width (doubled on KV-sharing layers under ``use_double_wide_mlp``)."""
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.shares_kv(layer) else 1)

    @property
    def embedding_scale(self) -> float:
        """``sqrt(hidden_size)``: the factor :func:`dflash_jax.families.gemma4.model.embed` applies."""
        return self.hidden_size ** 0.5

    def with_dtype(self, dtype: str) -> "Gemma4Config":
        return dataclasses.replace(self, dtype=str(dtype))


# (field, value it must have): options this implementation does not run, refused by name
_REFUSED = (("use_bidirectional_attention", None), ("attention_bias", False),
            ("attn_logit_softcapping", None), ("hidden_activation", "gelu_pytorch_tanh"))


def _rope(cfg: Mapping[str, Any], kind: str, source: str) -> tuple[str, float, float, float]:
    params = (cfg.get("rope_parameters") or {}).get(kind)
    where = f"{source}: field rope_parameters.{kind}"
    if not isinstance(params, Mapping):
        raise DFlashError(where, f"got {params!r}", "a dict with rope_type and rope_theta")
    rtype = params.get("rope_type", "default")
    if rtype not in ("default", "proportional"):
        raise DFlashError(f"{where}.rope_type", f"unsupported value {rtype!r}", "'default' or 'proportional'")
    extra = set(params) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
    if extra:
        raise DFlashError(where, f"unsupported keys {sorted(extra)}", "rope_type, rope_theta, partial_rotary_factor, factor")
    partial, factor = float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0))
    if rtype == "default" and (partial != 1.0 or factor != 1.0):
        raise DFlashError(where, f"partial_rotary_factor={partial}, factor={factor} with rope_type 'default'", "1.0 (ignored by transformers)")
    return rtype, float(_get(params, "rope_theta", where, (int, float))), partial, factor


def _full_layer_sizes(cfg: Mapping[str, Any], types: list, source: str) -> tuple[int, int]:
    """``(head_dim, kv heads)`` of the full layers: from ``per_layer_config`` (all full layers
    alike, no other overrides), else ``global_head_dim`` (default 512) and ``num_key_value_heads``
    (``num_global_key_value_heads`` where set under ``attention_k_eq_v``, as transformers'
    ``Gemma4TextConfig.__post_init__``)."""
    kv = int(_get(cfg, "num_key_value_heads", source, int))
    per = cfg.get("per_layer_config")
    if per is None:
        if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
            kv = _positive(int(_get(cfg, "num_global_key_value_heads", source, int)), "num_global_key_value_heads", source)
        return _positive(int(_get(cfg, "global_head_dim", source, int, 512)), "global_head_dim", source), kv
    where = f"{source}: field per_layer_config"
    sizes = set()
    for i, t in enumerate(types):
        over = per.get(str(i), per.get(i, {})) or {}
        if t != "full_attention" and over:
            raise DFlashError(f"{where}.{i}", f"overrides {over!r} on a sliding layer", "overrides on full layers only")
        if set(over) - {"head_dim", "num_key_value_heads"}:
            raise DFlashError(f"{where}.{i}", f"unsupported keys {sorted(set(over) - {'head_dim', 'num_key_value_heads'})}",
                              "head_dim, num_key_value_heads")
        if t == "full_attention":
            sizes.add((int(over.get("head_dim", cfg.get("head_dim"))), int(over.get("num_key_value_heads", kv))))
    if len(sizes) > 1:
        raise DFlashError(where, f"full layers of different sizes {sorted(sizes)}", "one (head_dim, num_key_value_heads) for all")
    return sizes.pop() if sizes else (int(cfg.get("head_dim")), kv)


def _kv_shared(cfg: Mapping[str, Any], n_layers: int, source: str) -> int:
    n = int(_get(cfg, "num_kv_shared_layers", source, int, 0))
    if not 0 <= n < n_layers:
        raise DFlashError(f"{source}: field num_kv_shared_layers", f"got {n}", f"in [0, num_hidden_layers={n_layers})")
    return n


def _moe(cfg: Mapping[str, Any], source: str) -> dict:
    """``num_experts``, ``top_k_experts``, ``moe_intermediate_size`` under ``enable_moe_block`` (all 0 without)."""
    if not cfg.get("enable_moe_block"):
        return {}
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    moe = {k: _positive(_get(cfg, k, source, int), k, source) for k in keys}
    if moe["top_k_experts"] > moe["num_experts"]:
        raise DFlashError(f"{source}: field top_k_experts", f"{moe['top_k_experts']}", f"at most num_experts={moe['num_experts']}")
    return moe


def gemma4_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> Gemma4Config:
    """Builds a :class:`Gemma4Config` from a parsed ``config.json`` (``Gemma4TextConfig``, or a
    ``Gemma4ForConditionalGeneration``'s nested ``text_config``: its text decoder; a top-level
    ``tie_word_embeddings`` applies where the text config has none).

    ``layer_types`` defaults to transformers' pattern (every sixth layer full) and its last
    entry is forced to ``full_attention`` as transformers does.

    Raises:
      DFlashError: a required field missing or ill-typed, a non-positive size, or an option this
        implementation does not run: ``use_bidirectional_attention``, ``attention_bias``,
        ``attn_logit_softcapping``, a ``hidden_activation`` other than ``gelu_pytorch_tanh``, a RoPE
        type other than ``default``/``proportional``; under ``enable_moe_block`` a missing or
        non-positive ``num_experts`` / ``top_k_experts`` / ``moe_intermediate_size``, or
        ``top_k_experts > num_experts``; names ``source`` and the field.
    """
    if isinstance(cfg.get("text_config"), Mapping):
        tied = cfg.get("tie_word_embeddings", True)
        cfg, source = dict({"tie_word_embeddings": tied}, **cfg["text_config"]), f"{source}: text_config"

    def pos(key, default=dataclasses.MISSING):
        return _positive(_get(cfg, key, source, int, default), key, source)

    for key, want in _REFUSED:
        if cfg.get(key) is not None and cfg.get(key) != want:
            raise DFlashError(f"{source}: field {key}", f"got {cfg.get(key)!r} (not implemented)", f"{want!r}")
    n_layers = pos("num_hidden_layers")
    types = list(cfg.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)])
    if len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise DFlashError(f"{source}: field layer_types", f"got {types!r}", f"{n_layers} entries of {LAYER_TYPES}")
    types[-1] = "full_attention"
    full_dim, full_kv = _full_layer_sizes(cfg, types, source)
    ple = int(_get(cfg, "hidden_size_per_layer_input", source, int, 0) or 0)
    softcap = cfg.get("final_logit_softcapping")
    return Gemma4Config(
        vocab_size=pos("vocab_size"), hidden_size=pos("hidden_size"), intermediate_size=pos("intermediate_size"),
        num_hidden_layers=n_layers, num_attention_heads=pos("num_attention_heads"), layer_types=tuple(types),
        head_dims=(pos("head_dim"), _positive(full_dim, "head_dim", source)),
        kv_heads=(pos("num_key_value_heads"), _positive(full_kv, "num_key_value_heads", source)),
        ropes=tuple(_rope(cfg, t, source) for t in LAYER_TYPES), sliding_window=pos("sliding_window"),
        per_layer_input=ple, per_layer_vocab=pos("vocab_size_per_layer_input") if ple else 0,
        final_logit_softcapping=float(softcap) if softcap else 0.0, num_kv_shared_layers=_kv_shared(cfg, n_layers, source),
        use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp") or False), attention_k_eq_v=bool(cfg.get("attention_k_eq_v") or False),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", source, (int, float), 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 131072), **_moe(cfg, source),
    )
