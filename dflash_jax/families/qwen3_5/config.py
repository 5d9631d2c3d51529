"""Static, hashable configuration of the Qwen3.5 hybrid targets: ``Qwen3_5ForCausalLM`` and its
sparse siblings ``Qwen3NextForCausalLM`` (``variant`` ``"qwen3_next"``: the same layers with a MoE MLP)
and ``Qwen3_5MoeForCausalLM`` (``"qwen3_5_moe"``: Qwen3.5's layers with Qwen3-Next's MoE).

Parsed strictly from HF ``config.json`` (transformers 5.25 ``Qwen3_5TextConfig`` / ``Qwen3NextConfig`` / ``Qwen3_5MoeTextConfig``,
the text part only). Every problem raises :class:`~dflash_jax.errors.DFlashError` naming the file and the field.

Rules taken from transformers ``configuration_qwen3_5.py`` / ``modeling_qwen3_5.py``:

* ``layer_types``: ``linear_attention`` (Gated DeltaNet) or ``full_attention``; when absent,
  every ``full_attention_interval``-th layer (default 4) is full, the others linear.
* ``rope_parameters``: ``rope_theta`` (default 10000) and ``partial_rotary_factor`` (default
  0.25: only the first quarter of each head rotates). ``mrope_section`` / ``mrope_interleaved``
  describe the multimodal 3-D RoPE; for text the three position rows are equal, so the
  recomposed table is the plain 1-D one and both keys are ignored. Only ``rope_type``
  ``"default"`` is accepted.
* ``hidden_act`` must be ``silu`` (the MLP, the convolution and the output gate all use it) and
  ``attention_bias`` false (no published model sets it; refused rather than ignored).
* A nested ``text_config`` (``Qwen3_5ForConditionalGeneration``) is read in place of the top level.
* Qwen3-Next: every layer's MLP is the MoE (``num_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size``, ``shared_expert_intermediate_size``, ``norm_topk_prob``); a
  ``decoder_sparse_step`` other than 1 or a non-empty ``mlp_only_layers`` (dense and sparse
  layers mixed, which no published model does) is refused.
* Qwen3.5-MoE (``modeling_qwen3_5_moe.py``): Qwen3.5's linear-attention projections, every MLP
  Qwen3-Next's MoE; its router always renormalises the top-k weights (``norm_topk_prob`` is
  not read) and its config has no ``intermediate_size`` (unused: taken as ``moe_intermediate_size``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping
from dflash_jax.families.hf_config import RopeConfig, _get
from dflash_jax.errors import DFlashError


LAYER_TYPES = ("linear_attention", "full_attention")
HF_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM",
                    "Qwen3_5MoeForConditionalGeneration")
HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
VARIANTS = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
ROLLBACKS = ("states", "replay")


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
    """A Qwen3.5 hybrid decoder in the terms of HF ``config.json``.

    ``layer_types``: one of :data:`LAYER_TYPES` per layer. Full-attention layers: ``num_attention_heads``
    query heads of ``head_dim`` with a per-element sigmoid output gate, ``num_key_value_heads``
    K/V heads, per-head q/k RMSNorm, RoPE on ``rope.partial`` of each head. Linear layers
    (Gated DeltaNet): ``linear_num_key_heads`` q/k heads of ``linear_key_head_dim``,
    ``linear_num_value_heads`` value heads of ``linear_value_head_dim``, a causal depthwise
    convolution of ``linear_conv_kernel_dim`` taps. ``dtype``: parameter and compute dtype name.

    ``rollback``: how a verify's rejected drafts are kept out of the linear layers' recurrent
    state (:mod:`dflash_jax.families.qwen3_5.model`): ``"states"`` keeps the state after every block
    position (no extra computation; ``Ll * (T + 1) * Hv * dk * dv * 4`` bytes per row during a
    verify), ``"replay"`` keeps each position's recurrence inputs and reruns the recurrence alone
    over the committed prefix (``(dk + dv + 2) / (dk * dv)`` of that memory, one more pass of the
    rank-1 updates). Not a ``config.json`` field: ``cfg.replace(rollback=...)``.

    ``variant``: ``"qwen3_5"`` (SwiGLU MLP), ``"qwen3_next"`` (every MLP a MoE of
    ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, softmax router, top
    ``num_experts_per_tok`` renormalised when ``norm_topk_prob``, plus a shared expert of
    ``shared_expert_intermediate_size`` scaled by a sigmoid gate; its checkpoints group the
    linear projections per key head) or ``"qwen3_5_moe"`` (that MoE, Qwen3.5's projections).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig(partial=0.25)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    variant: str = "qwen3_5"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rollback: str = "states"
    dtype: str = "float32"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise DFlashError("config: variant", f"got {self.variant!r}", f"one of {VARIANTS}")
        if self.sparse and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise DFlashError("config: num_experts_per_tok", f"{self.num_experts_per_tok} of {self.num_experts} experts",
                              "between 1 and num_experts")
        if self.rollback not in ROLLBACKS:
            raise DFlashError("config: rollback", f"got {self.rollback!r}", f"one of {ROLLBACKS}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError("config: layer_types", f"{len(self.layer_types)} entries", f"{self.num_hidden_layers} (num_hidden_layers)")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise DFlashError("config: layer_types", f"unsupported entry {bad[0]!r}", f"each one of {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError("config: num_key_value_heads", f"{self.num_key_value_heads} does not divide num_attention_heads="
                              f"{self.num_attention_heads}", "a divisor of num_attention_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise DFlashError("config: linear_num_key_heads", f"{self.linear_num_key_heads} does not divide linear_num_value_heads="
                              f"{self.linear_num_value_heads}", "a divisor of linear_num_value_heads")

    @property
    def family(self) -> str:
        return self.variant

    @property
    def sparse(self) -> bool:
        """Every layer's MLP is the MoE (Qwen3-Next, Qwen3.5-MoE)."""
        return self.variant in ("qwen3_next", "qwen3_5_moe")


    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers, in order (row ``j`` of the ``"linear"`` stacks)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers, in order (row ``j`` of the ``"full"`` stacks and the KV cache)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: queries, keys, then values (``2 Hk dk + Hv dv``)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def with_dtype(self, dtype: str) -> "Qwen3_5Config":
        return dataclasses.replace(self, dtype=str(dtype))

    def replace(self, **changes) -> "Qwen3_5Config":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


def _pos_int(cfg: Mapping[str, Any], key: str, where: str, default=dataclasses.MISSING) -> int:
    value = _get(cfg, key, where, int, default)
    if value <= 0:
        raise DFlashError(f"{where}: field {key}", f"got {value}", "a positive integer")
    return int(value)


def _layer_types(cfg: Mapping[str, Any], where: str, n: int) -> tuple:
    types = cfg.get("layer_types")
    if types is None:
        interval = _pos_int(cfg, "full_attention_interval", where, 4)
        return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(n))
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise DFlashError(f"{where}: field layer_types", f"got {types!r}", f"{n} entries (num_hidden_layers), each one of {LAYER_TYPES}")
    return tuple(types)


def _rope(cfg: Mapping[str, Any], where: str) -> RopeConfig:
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise DFlashError(f"{where}: field rope_parameters", f"got {params!r}", "a JSON object")
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise DFlashError(f"{where}: field rope_parameters.rope_type", f"unsupported value {kind!r}", "default")
    theta = _get(params, "rope_theta", f"{where}: rope_parameters", (int, float), cfg.get("rope_theta", 10000.0))
    partial = _get(params, "partial_rotary_factor", f"{where}: rope_parameters", (int, float), cfg.get("partial_rotary_factor", 0.25))
    if not 0 < partial <= 1:
        raise DFlashError(f"{where}: field rope_parameters.partial_rotary_factor", f"got {partial}", "a fraction in (0, 1]")
    return RopeConfig(theta=float(theta), partial=float(partial))


def qwen3_5_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> Qwen3_5Config:
    """Builds a :class:`Qwen3_5Config` from a parsed ``config.json`` (its ``text_config`` when nested).

    Raises:
      DFlashError: a missing or ill-typed field, ``layer_types`` of the wrong length or with
        unknown entries, a ``rope_type`` other than default, ``hidden_act`` other than silu,
        ``attention_bias`` true, or (Qwen3-Next) dense and sparse MLP layers mixed (messages name
        ``source`` and the field).
    """
    variant = _variant(cfg)
    where, tied = source, cfg.get("tie_word_embeddings", False)
    if isinstance(cfg.get("text_config"), Mapping):
        cfg, where = cfg["text_config"], f"{source}: text_config"
        tied = cfg.get("tie_word_embeddings", tied)
    if cfg.get("attention_bias"):
        raise DFlashError(f"{where}: field attention_bias", "true is not supported", "false")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise DFlashError(f"{where}: field hidden_act", f"unsupported value {act!r}", "silu")
    n = _pos_int(cfg, "num_hidden_layers", where)
    moe = _moe(cfg, where, variant) if variant != "qwen3_5" else {}
    return Qwen3_5Config(
        vocab_size=_pos_int(cfg, "vocab_size", where),
        hidden_size=_pos_int(cfg, "hidden_size", where),
        intermediate_size=_pos_int(cfg, "intermediate_size", where, moe.get("moe_intermediate_size", dataclasses.MISSING)),
        num_hidden_layers=n,
        num_attention_heads=_pos_int(cfg, "num_attention_heads", where),
        num_key_value_heads=_pos_int(cfg, "num_key_value_heads", where),
        head_dim=_pos_int(cfg, "head_dim", where, 256),
        layer_types=_layer_types(cfg, where, n),
        linear_conv_kernel_dim=_pos_int(cfg, "linear_conv_kernel_dim", where, 4),
        linear_key_head_dim=_pos_int(cfg, "linear_key_head_dim", where, 128),
        linear_value_head_dim=_pos_int(cfg, "linear_value_head_dim", where, 128),
        linear_num_key_heads=_pos_int(cfg, "linear_num_key_heads", where, 16),
        linear_num_value_heads=_pos_int(cfg, "linear_num_value_heads", where, 32),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", where, (int, float), 1e-6)),
        rope=_rope(cfg, where),
        tie_word_embeddings=bool(tied),
        max_position_embeddings=_pos_int(cfg, "max_position_embeddings", where, 32768),
        variant=variant,
        **moe,
    )


def _variant(cfg: Mapping[str, Any]) -> str:
    """``"qwen3_next"``, ``"qwen3_5_moe"`` or ``"qwen3_5"`` from ``architectures`` (else ``model_type``)."""
    archs, kind = " ".join(cfg.get("architectures") or []), str(cfg.get("model_type") or "")
    nested = cfg.get("text_config")
    kind = kind or (str(nested.get("model_type") or "") if isinstance(nested, Mapping) else "")
    if "Qwen3NextForCausalLM" in archs or kind == "qwen3_next":
        return "qwen3_next"
    if "Qwen3_5Moe" in archs or kind.startswith("qwen3_5_moe"):
        return "qwen3_5_moe"
    return "qwen3_5"


def _moe(cfg: Mapping[str, Any], where: str, variant: str) -> dict:
    """The MoE fields of a Qwen3-Next / Qwen3.5-MoE ``config.json`` (transformers' defaults);
    refuses mixed dense / sparse layers. Qwen3.5-MoE always renormalises (module docstring)."""
    step, dense = _get(cfg, "decoder_sparse_step", where, int, 1), cfg.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise DFlashError(f"{where}: field {'decoder_sparse_step' if step != 1 else 'mlp_only_layers'}",
                          f"got {step if step != 1 else dense!r}: dense and MoE layers mixed are not supported",
                          "decoder_sparse_step 1 and no mlp_only_layers (every layer a MoE)")
    nxt = variant == "qwen3_next"
    return dict(num_experts=_pos_int(cfg, "num_experts", where, 512 if nxt else 256),
                num_experts_per_tok=_pos_int(cfg, "num_experts_per_tok", where, 10 if nxt else 8),
                moe_intermediate_size=_pos_int(cfg, "moe_intermediate_size", where, 512),
                shared_expert_intermediate_size=_pos_int(cfg, "shared_expert_intermediate_size", where, 512),
                norm_topk_prob=bool(_get(cfg, "norm_topk_prob", where, bool, True)) if nxt else True)
