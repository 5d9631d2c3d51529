"""The drafter's config (:class:`DrafterConfig`), its fit to a target (:func:`check_drafter_fits`) and
the parsers of both kinds' ``config.json``: z-lab's (:func:`dflash_drafter_config_from_hf`) and
Laguna's (:func:`laguna_drafter_config_from_hf`, on the Laguna target config's field readers).

Configs are frozen dataclasses: they are passed to jitted functions as static arguments, so two
equal configs share one compilation. Parsing is strict: a missing or ill-typed field raises
:class:`~dflash_jax.errors.DFlashError` naming the file and field; nothing is guessed silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dflash_jax.errors import DFlashError
from dflash_jax.families.hf_config import RopeConfig, _get, _positive, _tname, parse_rope
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.families.laguna.config import LAYER_TYPES, _layer_list, parse_gating
from dflash_jax.families.laguna.config import _num as _laguna_num, _pos_int as _laguna_pos_int

DFLASH_DRAFTER = "DFlashDraftModel"
LAGUNA_DRAFTER = "DFlashLagunaForCausalLM"
DFLASH2_DRAFTER = "DFlash2DraftModel"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash drafter (z-lab ``DFlashDraftModel``: Qwen3-style layers with KV injection).

    ``layer_causal[i]`` / ``layer_window[i]`` give each draft layer's attention inside the block:
    causal or bidirectional, and a sliding window over positions (0 = none).
    ``post_norm_last``: read the target's last layer after its final norm (transformers'
    ``hidden_states[L]``) instead of the pre-norm residual; only matters when the last layer is
    captured. Source: z-lab ``dflash/model.py`` (PyPI 0.1.0) and ``docs/specs/dflash.md`` section 1.

    ``architecture == "DFlashLagunaForCausalLM"`` (see :mod:`dflash_jax.drafter.laguna`):
    per-capture aux norms, context through each layer's input norm, and a softplus output gate
    ``gate`` = ``"head"`` or ``"element"`` (``gating_explicit``: named by the config, so a
    contradicting ``g_proj`` width is refused).

    ``draft_vocab_size``: 0 drafts over the target's whole vocabulary; ``Vd > 0`` over the
    ``Vd`` ids in the params' ``draft_ids`` (see :mod:`dflash_jax.drafter.vocab`).

    ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping`` act on the target
    family's ``embed`` / ``lm_head`` outputs; a z-lab config's values (relative to the raw
    embedding and head) are restated so by :func:`dflash_jax.drafter.knobs.knobs_through_family`;
    ``raw_head``: the draft logits come from the target's head before the family's soft-cap (a
    Gemma drafter whose own cap differs from its target's, or is unset).

    ``architecture == "DFlash2DraftModel"`` (:mod:`dflash_jax.drafter.dflash2`): grouped dynamic
    causal convolutions of ``conv_kernel_size`` taps over channel groups of ``conv_group_size``
    around every sublayer, and a candidate selector of rank ``selector_rank`` over the head's
    ``selector_top_k`` best tokens per slot (all four 0 for the other kinds).
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
    raw_head: bool = False
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
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
    architecture is checked by :func:`dflash_jax.drafter.model.drafter_config_from_hf`).

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


# ----------------------------------------------------------------------------------- Laguna drafters


def _dflash_int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    """A required integer drafter field (``dflash_config`` first, then the top level)."""
    v = _dflash_value(cfg, key, source=where)
    if v is None or isinstance(v, bool) or not isinstance(v, int):
        raise DFlashError(f"{where}: field {key}", "missing (top level or dflash_config)" if v is None else f"got {v!r}", "an integer")
    return int(v)


def _drafter_layer_ids(cfg: Mapping[str, Any], where: str) -> tuple:
    """``target_layer_ids`` from ``dflash_config``, else ``eagle_aux_hidden_state_layer_ids``
    minus one (both present: they must agree); strictly increasing."""
    ids = _dflash_value(cfg, "target_layer_ids", source=where)
    eagle = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and eagle is not None:
        ids = [int(i) - 1 for i in eagle]
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DFlashError(f"{where}: field target_layer_ids", f"got {ids!r}", "a non-empty list of layer indices (dflash_config)")
    if eagle is not None and [int(i) - 1 for i in eagle] != list(ids):
        raise DFlashError(f"{where}: field eagle_aux_hidden_state_layer_ids", f"{eagle} is not target_layer_ids + 1 ({list(ids)})", "ids + 1")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise DFlashError(f"{where}: field target_layer_ids", f"got {list(ids)}", "strictly increasing ids")
    return tuple(int(i) for i in ids)


def _drafter_rope(cfg: Mapping[str, Any], where: str) -> RopeConfig:
    """Plain NeoX RoPE: top-level ``rope_theta``, or a nested ``rope_parameters``' sliding sub-dict."""
    rp = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    partial = cfg.get("partial_rotary_factor") or 1.0
    if isinstance(rp, Mapping):
        sub = rp.get("sliding_attention", rp) if ("sliding_attention" in rp or "full_attention" in rp) else rp
        sub = sub if sub is not None else rp.get("full_attention")
        if sub.get("rope_type", "default") != "default":
            raise DFlashError(f"{where}: field rope_parameters.rope_type", f"got {sub.get('rope_type')!r}", "default")
        theta = sub.get("rope_theta", theta)
        partial = sub.get("partial_rotary_factor", partial)
    if theta is None:
        raise DFlashError(f"{where}: field rope_theta", "missing", "the drafter's RoPE base (500000 for the published drafters)")
    return RopeConfig(theta=float(theta), partial=float(partial))


def laguna_drafter_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
    """A :class:`~dflash_jax.drafter.config.DrafterConfig` for ``DFlashLagunaForCausalLM``.

    Rules (``docs/specs/laguna.md`` 6.2, vLLM ``laguna_dflash.py``, mlx-vlm's validator):

    * ``head_dim`` missing -> 128 (the Laguna default), never ``hidden_size // heads``.
    * ``dflash_config.block_size`` / ``mask_token_id`` / ``num_target_layers`` required;
      ``target_layer_ids`` from ``dflash_config`` or else ``eagle_aux_hidden_state_layer_ids``
      minus one (when both are present they must agree), strictly increasing.
    * Block attention causal per ``dflash_config.causal`` (default true); ``sliding_attention``
      layers windowed by ``sliding_window`` (per query over ``[context | block]``).
    * RoPE: plain NeoX, theta from top-level ``rope_theta``; a nested ``rope_parameters`` gives
      its ``sliding_attention`` sub-dict (vLLM ``_resolve_rope_params``); YaRN is refused.
    * ``gating``: per-head unless ``"per-element"``; ``draft_vocab_size`` must equal ``vocab_size``.

    Raises:
      DFlashError: naming ``source`` and the field.
    """
    where = source
    n = _laguna_pos_int(cfg, "num_hidden_layers", where)
    heads = _laguna_pos_int(cfg, "num_attention_heads", where)
    vocab = _laguna_pos_int(cfg, "vocab_size", where)
    dv = cfg.get("draft_vocab_size")
    if dv is not None and dv != vocab:
        raise DFlashError(f"{where}: field draft_vocab_size", f"{dv} differs from vocab_size", f"{vocab}")
    block = _dflash_int(cfg, "block_size", where)
    if block < 2:
        raise DFlashError(f"{where}: field block_size", f"got {block}", "an integer >= 2")
    ids = _drafter_layer_ids(cfg, where)
    causal = _dflash_value(cfg, "causal", True, where)
    types = _layer_list(cfg, "layer_types", where, n, LAYER_TYPES, ["sliding_attention"] * n)
    window = 0
    if "sliding_attention" in types:
        window = _laguna_pos_int(cfg, "sliding_window", where)
    per_head, explicit = parse_gating(cfg.get("gating", True), where)
    return DrafterConfig(
        hidden_size=_laguna_pos_int(cfg, "hidden_size", where), intermediate_size=_laguna_pos_int(cfg, "intermediate_size", where), num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=_laguna_pos_int(cfg, "num_key_value_heads", where, heads),
        head_dim=_laguna_pos_int(cfg, "head_dim", where, 128), vocab_size=vocab, block_size=block,
        mask_token_id=_dflash_int(cfg, "mask_token_id", where), target_layer_ids=ids,
        num_target_layers=_dflash_int(cfg, "num_target_layers", where), layer_causal=(bool(causal),) * n,
        layer_window=tuple(window if t == "sliding_attention" else 0 for t in types),
        rms_norm_eps=float(_laguna_num(cfg, "rms_norm_eps", where, (int, float), 1e-6)),
        rope=_drafter_rope(cfg, where), architecture="DFlashLagunaForCausalLM",
        gate="head" if per_head else "element", gating_explicit=explicit,
    )
