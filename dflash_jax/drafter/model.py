"""DFlash drafters: the kinds, keyed by architecture, and the functions every caller uses over them.

**Kinds.** A :class:`DrafterKind` names a drafter ``architectures`` value, its config parser, its
model module and its loaders; adding a kind is one entry in :data:`DRAFTER_KINDS`
(:mod:`dflash_jax.drafter.generic` for z-lab ``DFlashDraftModel``, :mod:`dflash_jax.drafter.laguna`
for ``DFlashLagunaForCausalLM``, :mod:`dflash_jax.drafter.dflash2` for ``DFlash2DraftModel``, whose
candidate selector, :mod:`dflash_jax.drafter.selector`, is reached through :func:`has_selector`,
:func:`selector_inputs`, :func:`select` and :func:`selector_scores`). Loading asks here (:func:`drafter_config_from_hf`,
:func:`load_hf_drafter`, :func:`load_gguf_drafter`).

**The model, as pure functions over a parameter pytree.** Captured target features are fused and
injected as context K/V in every draft layer (:func:`context_kv`); queries come only from the block
``[anchor, MASK, ...]``, embedded with the target's embedding; the final hidden goes through the
target's LM head (:func:`logits`) or the reduced draft vocabulary's head. Each kind gives its
parameters, context K/V and draft pass; this module dispatches by ``cfg.architecture`` and adds
what is common (draft vocabulary leaves, logits). The target's embedding and head come from its
family's :class:`~dflash_jax.families.contract.FamilyModel`, which the caller passes (``family``:
``dflash_jax.families.registry.module_for(target_cfg)``); nothing here looks the family up.

Source: z-lab ``dflash/model.py`` (PyPI ``dflash==0.1.0``: ``compute_logits``) and
``docs/specs/dflash.md`` sections 1.5-1.8.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from dflash_jax.drafter import config as drafter_config
from dflash_jax.drafter import dflash2 as dflash2_drafter
from dflash_jax.drafter import generic as dflash_drafter
from dflash_jax.drafter import knobs as drafter_knobs
from dflash_jax.drafter import laguna as laguna_drafter
from dflash_jax.drafter import selector as candidate_selector
from dflash_jax.drafter.config import DrafterConfig
from dflash_jax.errors import DFlashError
from dflash_jax.families import hf_config as family_config
from dflash_jax.families.contract import FamilyModel
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.formats import gguf_file
from dflash_jax.formats.checkpoint import numpy_dtype
from dflash_jax.nn import params as P
from dflash_jax.nn import quant
from dflash_jax.nn.params import ParamSpec


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """One DFlash drafter kind (``DrafterConfig.architecture``).

    Attributes:
      architecture: the ``config.json`` ``architectures`` entry.
      parse_hf: ``(config dict, source) -> DrafterConfig``.
      model: the model module (``param_specs``, ``context_kv``, ``forward``), used through
        :mod:`dflash_jax.drafter.model`.
      load_hf: ``(folder, cfg, numpy dtype) -> (cfg, params)`` (weights of a checked config).
      gguf_architectures: GGUF ``general.architecture`` values of its GGUF form (none: no GGUF).
      load_gguf: ``(path, target cfg, dtype, weights=) -> (cfg, params)`` of a GGUF drafter file.
      per_layer: its draft layers may be held per layer (:func:`dflash_jax.nn.params.unstack_layers`).
    """

    architecture: str
    parse_hf: Callable[[Mapping[str, Any], str], Any]
    model: ModuleType
    load_hf: Callable[..., tuple[Any, dict]]
    gguf_architectures: tuple[str, ...] = ()
    load_gguf: Callable[..., tuple[Any, dict]] | None = None
    per_layer: bool = False


DRAFTER_KINDS: tuple[DrafterKind, ...] = (
    DrafterKind(architecture=drafter_config.DFLASH_DRAFTER, parse_hf=drafter_config.dflash_drafter_config_from_hf, model=dflash_drafter,
                load_hf=dflash_drafter.load_dflash_drafter_weights, per_layer=True),
    DrafterKind(architecture=drafter_config.LAGUNA_DRAFTER, parse_hf=drafter_config.laguna_drafter_config_from_hf, model=laguna_drafter,
                load_hf=laguna_drafter.load_laguna_drafter_safetensors, gguf_architectures=("dflash-draft", "dflash"),
                load_gguf=laguna_drafter.load_laguna_drafter_gguf),
    DrafterKind(architecture=drafter_config.DFLASH2_DRAFTER, parse_hf=dflash2_drafter.dflash2_drafter_config_from_hf, model=dflash2_drafter,
                load_hf=dflash2_drafter.load_dflash2_drafter_weights, per_layer=True),
)

# recognised and refused by name, with the reason (none at present)
REFUSED_DRAFTERS: dict[str, str] = {}


def drafter_kind(architecture: str) -> DrafterKind:
    """The registered drafter kind of ``DrafterConfig.architecture``. Raises DFlashError if none."""
    for kind in DRAFTER_KINDS:
        if kind.architecture == architecture:
            return kind
    raise DFlashError("drafter config: architecture", f"unsupported value {architecture!r}", f"one of {drafter_architectures()}")


def drafter_architectures() -> tuple[str, ...]:
    """The ``architectures`` values of every registered drafter kind."""
    return tuple(k.architecture for k in DRAFTER_KINDS)


def drafter_config_from_hf(cfg: Mapping[str, Any], source: str = "config.json"):
    """A :class:`~dflash_jax.drafter.config.DrafterConfig` from a drafter ``config.json``, parsed by the
    kind its ``architectures`` names.

    Raises:
      DFlashError: an unsupported architecture or whatever the kind's parser finds (``source`` and the field named).
    """
    archs = list(cfg.get("architectures") or [])
    for arch in archs:
        if arch in REFUSED_DRAFTERS:
            raise DFlashError(f"{source}: field architectures", f"{arch}: {REFUSED_DRAFTERS[arch]}", f"one of {drafter_architectures()}")
    arch = next((a for a in archs if a in drafter_architectures()), None)
    if arch is None:
        raise DFlashError(f"{source}: field architectures", f"unsupported drafter {archs!r}", f"one of {drafter_architectures()}")
    return drafter_kind(arch).parse_hf(cfg, source)


def load_hf_drafter(folder: str | os.PathLike, target_cfg=None, dtype: str = "float32") -> tuple[Any, dict]:
    """Loads a DFlash drafter folder (``config.json`` + safetensors) as ``(DrafterConfig, params)``.

    Args:
      folder: the checkpoint folder.
      target_cfg: when given, the drafter is checked against it (hidden size, vocab, captured
        layer ids, mask id, block size) and a DFlash drafter's ``input_embedding_scale`` /
        ``final_logit_softcapping`` are restated against the target family's embedding and head
        (:func:`dflash_jax.drafter.knobs.knobs_through_family`).
      dtype: parameter dtype name.
    Returns:
      The config and the params of the kind's model (:mod:`dflash_jax.drafter.model`,
      :mod:`dflash_jax.drafter.laguna`).
    Raises:
      DFlashError: not a folder, bad config fields, a drafter that does not fit the target, or
        missing / unexpected / mis-shaped tensors (file and field or tensor named).
    """
    folder = str(folder)
    if not os.path.isdir(folder):
        raise DFlashError(folder, "not a directory", "a drafter checkpoint folder with config.json")
    target = numpy_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    cfg = drafter_config_from_hf(family_config.read_json(config_path), config_path).with_dtype(target.name)
    if target_cfg is not None:
        drafter_config.check_drafter_fits(cfg, target_cfg, source=config_path)
        if cfg.architecture in (drafter_config.DFLASH_DRAFTER, drafter_config.DFLASH2_DRAFTER):  # z-lab's knobs, against the family
            cfg = drafter_knobs.knobs_through_family(cfg, target_cfg, config_path)
    return drafter_kind(cfg.architecture).load_hf(folder, cfg, target)


def load_gguf_drafter(path: str | os.PathLike, target_cfg, dtype: str = "float32", weights: str = "float") -> tuple[Any, dict]:
    """Loads a drafter ``.gguf`` file as ``(DrafterConfig, params)`` by the kind its
    ``general.architecture`` names (``dflash-draft`` / ``dflash``: Laguna drafters); ``weights``
    ``"quantized"`` keeps its quantized matrices quantized (``"float"``: all dequantized).

    Raises:
      DFlashError: a file of no registered drafter kind, or whatever the kind's loader finds
        (the drafter must fit ``target_cfg``).
    """
    arch = gguf_file.architecture(path)
    for kind in DRAFTER_KINDS:
        if arch in kind.gguf_architectures:
            return kind.load_gguf(path, target_cfg, dtype, weights=weights)
    known = tuple(a for k in DRAFTER_KINDS for a in k.gguf_architectures)
    raise DFlashError(f"{path}: key general.architecture", f"got {arch!r}", f"one of {known} (a DFlash drafter GGUF)")


def _model(cfg: DrafterConfig):
    """The model module of the drafter's kind (:data:`dflash_jax.drafter.model.DRAFTER_KINDS`)."""
    return drafter_kind(cfg.architecture).model


def param_specs(cfg: DrafterConfig) -> dict:
    """The :class:`~dflash_jax.nn.params.ParamSpec` (shape, logical axes, initialiser) of every
    drafter parameter, as a pytree shaped like the params: the kind's, plus the draft-vocabulary
    leaves."""
    return _with_draft_vocab(cfg, _model(cfg).param_specs(cfg))


def _with_draft_vocab(cfg: DrafterConfig, specs: dict) -> dict:
    """Adds the reduced-vocabulary leaves ``draft_ids [Vd]`` (int32, initialised ``0..Vd-1``) and
    ``draft_head [H, Vd]`` when the config has a draft vocabulary."""
    if not cfg.draft_vocab_size:
        return specs
    Vd = cfg.draft_vocab_size
    return dict(specs, draft_ids=ParamSpec((Vd,), ("draft_vocab",), "arange"),
                draft_head=ParamSpec((cfg.hidden_size, Vd), ("embed", "draft_vocab")))


def param_shapes(cfg: DrafterConfig) -> dict:
    """Expected shape of every drafter parameter, as a pytree shaped like the params."""
    return P.shapes(param_specs(cfg))


def param_axes(cfg: DrafterConfig, per_layer: bool = False) -> dict:
    """Logical axis names of every drafter parameter leaf (with ``per_layer`` the tree of
    :func:`dflash_jax.nn.params.unstack_layers`: ``Ld`` dicts without the layer axis).

    Raises:
      DFlashError: ``per_layer`` for a Laguna drafter (its layers stay stacked).
    """
    if per_layer and not drafter_kind(cfg.architecture).per_layer:
        raise DFlashError("param_axes(per_layer=True)", "Laguna drafters keep stacked layers", "per_layer=False")
    return P.axes(param_specs(cfg), per_layer)


def init_params(cfg: DrafterConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Random drafter parameters (norm weights near 1) for tests and training from scratch."""
    return P.init(param_specs(cfg), key, scale, cfg.dtype)


def context_kv(params: dict, cfg: DrafterConfig, features: jnp.ndarray, positions: jnp.ndarray):
    """Projects captured target features into every draft layer's context keys and values (the
    kind's ``context_kv``: :func:`dflash_jax.drafter.generic.context_kv`,
    :func:`dflash_jax.drafter.laguna.context_kv`).

    Args:
      features: ``[B, T, K*H]`` concatenated captured hidden states (K = len(target_layer_ids)).
      positions: ``[B, T]`` int32 absolute positions of those tokens.
    Returns:
      ``(k, v)``, each ``[Ld, B, T, Hkv, D]``: ``k`` is ``k_norm``-ed and rotated, ``v`` raw.
    """
    return _model(cfg).context_kv(params, cfg, features, positions)


def forward(
    params: dict,
    cfg: DrafterConfig,
    family: FamilyModel,
    target_params: dict,
    target_cfg: TargetConfig,
    block_tokens: jnp.ndarray,
    positions: jnp.ndarray,
    ctx_k: jnp.ndarray,
    ctx_v: jnp.ndarray,
    ctx_len: jnp.ndarray,
    block_len: jnp.ndarray | None = None,
    live_context: bool = True,
    pages=None,
) -> jnp.ndarray:
    """One draft pass over a block.

    Args:
      family: the target's family model (:func:`dflash_jax.families.registry.module_for` of
        ``target_cfg``), whose ``embed`` embeds the block.
      target_params, target_cfg: the target's parameters and static config.
      block_tokens: ``[B, W]`` int32, ``[anchor, mask_token_id, ...]``.
      positions: ``[B, W]`` int32 absolute positions (anchor at the row's last committed slot).
      ctx_k, ctx_v: ``[Ld, B, S, Hkv, D]`` context K/V from :func:`context_kv`, slot = position.
      ctx_len: ``[B]`` int32 valid context slots (``[0, ctx_len)``).
      block_len: ``[B]`` int32 existing block slots (default all ``W``).
      live_context: read only the context slots below ``max(ctx_len)`` (a loop with a traced
        trip count: cost follows the live context, not ``S``); ``False`` reads all ``S`` slots
        in one pass under the same mask (differentiable: training).
      pages: the context's :class:`~dflash_jax.runtime.carry.PagedKVCache` when ``ctx_k``/``ctx_v`` are
        paged pools ``[Ld, N, Hkv, D]`` (a paged serving batch), else ``None``.
    Returns:
      ``[B, W, H]`` final-normed hidden states; slot ``i`` predicts the token at
      ``positions[:, i]`` (slot 0 is discarded by callers). The kind's ``forward``, on the block
      embedded by the target's family (:attr:`dflash_jax.families.contract.FamilyModel.embed`: any family
      scaling applied, as z-lab embeds with the target's ``embed_tokens``).
    """
    embeds = family.embed(target_params, target_cfg, block_tokens)
    return _model(cfg).forward(params, cfg, embeds, positions, ctx_k, ctx_v, ctx_len, block_len, live_context, pages)


def logits(params: dict, cfg: DrafterConfig, family: FamilyModel, target_params: dict, target_cfg, hidden: jnp.ndarray) -> jnp.ndarray:
    """Draft logits float32 of final-normed drafter hidden states ``hidden [..., H]``.

    Through the target family's LM head (``family.lm_head`` of ``target_params``, ``target_cfg``;
    :attr:`dflash_jax.families.contract.FamilyModel.lm_head`, so any family soft-cap applies), with the drafter's
    ``output_multiplier`` and optional tanh soft-cap (z-lab ``compute_logits``). Returns
    ``[..., V]``, or ``[..., Vd]`` through ``params["draft_head"]`` when ``cfg.draft_vocab_size``
    is set (map indices back to target ids with :func:`draft_token_ids`).
    """
    if cfg.draft_vocab_size:
        return head_logits(cfg, family, target_cfg, hidden, params["draft_head"])
    return _finish_logits(cfg, family.lm_head(target_params, _head_cfg(cfg, target_cfg), hidden))


def _head_cfg(cfg: DrafterConfig, target_cfg):
    """The target config the drafter's head runs under: with ``cfg.raw_head``, the family's
    logit soft-cap off (z-lab's ``compute_logits`` reads the raw head;
    :func:`dflash_jax.drafter.knobs.knobs_through_family`)."""
    if cfg.raw_head and getattr(target_cfg, "final_logit_softcapping", 0.0):
        return dataclasses.replace(target_cfg, final_logit_softcapping=0.0)
    return target_cfg


def head_logits(cfg: DrafterConfig, family: FamilyModel, target_cfg, hidden: jnp.ndarray, head: jnp.ndarray) -> jnp.ndarray:
    """Draft logits ``[..., N]`` float32 of ``hidden [..., H]`` through ``head [H, N]`` (columns of the
    target head, :func:`dflash_jax.drafter.vocab.head_columns`; cast to ``hidden``'s dtype), computed by
    the target family's LM head (``family.lm_head``) as its head ``{"lm_head": head}`` (:attr:`dflash_jax.families.contract.FamilyModel.lm_head`),
    so that any family soft-cap applies to these columns as to the full head's; then the drafter's
    ``output_multiplier`` and soft-cap."""
    head_only = {"lm_head": quant.astype(head, hidden.dtype)}
    return _finish_logits(cfg, family.lm_head(head_only, _head_cfg(cfg, target_cfg), hidden))


def draft_token_ids(params: dict, cfg: DrafterConfig, index: jnp.ndarray) -> jnp.ndarray:
    """Target token ids of draft-logit indices: ``index [...]`` int -> ``[...]`` int32
    (``draft_ids[index]``; the identity without a draft vocabulary)."""
    return (jnp.take(params["draft_ids"], index) if cfg.draft_vocab_size else index).astype(jnp.int32)


def _finish_logits(cfg: DrafterConfig, out: jnp.ndarray) -> jnp.ndarray:
    out = out * cfg.output_multiplier
    if cfg.final_logit_softcapping > 0:
        cap = cfg.final_logit_softcapping
        out = jnp.tanh(out / cap) * cap
    return out


def has_selector(cfg: DrafterConfig) -> bool:
    """Whether the drafter picks its drafts with a candidate selector (DFlash2,
    :mod:`dflash_jax.drafter.selector`) rather than the argmax / a sample of its logits."""
    return cfg.selector_top_k > 0


def selector_inputs(params: dict, cfg: DrafterConfig, hidden: jnp.ndarray, logits: jnp.ndarray):
    """The selector's :class:`~dflash_jax.drafter.selector.SelectorInputs` of a draft pass: the
    top ``selector_top_k`` of ``logits [B, n, V']`` (mapped to target ids through a draft
    vocabulary) and ``hidden [B, n, H]`` (the final-normed hidden states of the draft slots)."""
    ids = params["draft_ids"] if cfg.draft_vocab_size else None
    return candidate_selector.inputs(params["selector"], min(cfg.selector_top_k, logits.shape[-1]), hidden, logits, ids)


def select(params: dict, cfg: DrafterConfig, x, anchor: jnp.ndarray, temperature=None, uniforms=None):
    """The selector's path and its distributions: :func:`dflash_jax.drafter.selector.select` with
    the drafter's selector params; ``(path [B, n] int32, q [B, n, k] float32)``."""
    return candidate_selector.select(params["selector"], x, anchor, temperature, uniforms)


def selector_scores(params: dict, x, slot, predecessor: jnp.ndarray) -> jnp.ndarray:
    """``[B, k]`` float32 pairwise scores of a slot's candidates after ``predecessor [B]``
    (:func:`dflash_jax.drafter.selector.scores`)."""
    return candidate_selector.scores(params["selector"], x, slot, predecessor)
