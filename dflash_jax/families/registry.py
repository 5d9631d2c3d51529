"""Target families and drafter kinds, keyed by architecture: the one place that knows them.

A :class:`TargetFamily` names a target's Hugging Face ``architectures`` / ``model_type`` and GGUF
``general.architecture`` values, its config type and parser, its model as a
:class:`~dflash_jax.families.contract.FamilyModel` (the typed contract every caller uses: ``embed``,
``forward_hidden``, ``lm_head``, ``init_cache``, ``param_axes``, ...) and its HF and GGUF loaders. A :class:`DrafterKind` names a DFlash drafter ``architectures`` value, its config parser
and its loaders. Every other module asks here (:func:`module_for`, :func:`family_for_hf`,
:func:`load_hf_target`, :func:`drafter_config_from_hf`, ...); adding a family or a drafter kind is
one entry in :data:`TARGET_FAMILIES` or :data:`DRAFTER_KINDS`.

Nothing this module imports may import it back (``tests/test_architecture.py`` fails on a cycle):
the modules registered here are the ones below it.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Any, Callable, Mapping
from dflash_jax.drafter import config as drafter_config
from dflash_jax.families import config as family_config
from dflash_jax.families.dense import config as dense_config
from dflash_jax.families.gemma4 import config as config_gemma4
from dflash_jax.families.gpt_oss import config as config_gpt_oss
from dflash_jax.families.laguna import config as config_laguna
from dflash_jax.families.qwen3_5 import config as config_qwen3_5
from dflash_jax.families.qwen3_moe import config as config_qwen3_moe
from dflash_jax.drafter import knobs as drafter_knobs
from dflash_jax.errors import DFlashError
from dflash_jax.families.contract import FamilyModel
from dflash_jax.drafter import generic as io_drafter
from dflash_jax.families.dense import gguf, gguf_cache
from dflash_jax.formats import gguf as gguf_file
from dflash_jax.formats.safetensors import numpy_dtype
from dflash_jax.families.dense import safetensors as hf
from dflash_jax.families.laguna import safetensors as laguna, gguf as laguna_gguf
from dflash_jax.drafter import laguna as laguna_drafter
from dflash_jax.families.gemma4 import safetensors as gemma4_io
from dflash_jax.families.gpt_oss import safetensors as gpt_oss_io
from dflash_jax.families.qwen3_5 import safetensors as qwen3_5_io
from dflash_jax.families.qwen3_moe import safetensors as qwen3_moe_io
from dflash_jax.families.gemma4 import gguf as gemma4_gguf
from dflash_jax.families.gpt_oss import gguf as gpt_oss_gguf
from dflash_jax.families.qwen3_5 import gguf as qwen3_5_gguf
from dflash_jax.families.qwen3_moe import gguf as qwen3_moe_gguf
from dflash_jax.families.dense import model as dense
from dflash_jax.drafter import generic as dflash_drafter
from dflash_jax.families.gemma4 import model as gemma4_model
from dflash_jax.families.gpt_oss import model as gpt_oss_model
from dflash_jax.families.laguna import model as laguna_model
from dflash_jax.drafter import laguna as laguna_drafter_model
from dflash_jax.families.qwen3_5 import model as qwen3_5_model
from dflash_jax.families.qwen3_moe import model as qwen3_moe_model


@dataclasses.dataclass(frozen=True)
class TargetFamily:
    """One target family.

    Attributes:
      name: ``"dense"``, ``"laguna"``, ...
      config_type: the static config class (``cfg`` of the model functions).
      hf_architectures: ``config.json`` ``architectures`` entries that select it.
      hf_model_types: ``config.json`` ``model_type`` values that select it when no entry does.
      gguf_architectures: GGUF ``general.architecture`` values that select it.
      parse_hf: ``(config dict, source) -> cfg``.
      model: its :class:`~dflash_jax.families.contract.FamilyModel` (``embed``, ``forward_hidden``, ``lm_head``,
        ``init_cache``, ...), checked against the contract when the registry is built.
      load_hf: ``(folder, dtype) -> (cfg, params)``.
      load_gguf: ``(path, dtype, use_cache, as_numpy) -> (cfg, params)``.
      gguf_config: ``(path, dtype) -> cfg`` from the GGUF's metadata and tensor list only.
      per_layer: its decoder layers may be held per layer (``models.dense.unstack_layers``).
    """

    name: str
    config_type: type
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    parse_hf: Callable[[Mapping[str, Any], str], Any]
    model: FamilyModel
    load_hf: Callable[..., tuple[Any, dict]]
    load_gguf: Callable[..., tuple[Any, dict]]
    gguf_config: Callable[[str, str], Any]
    per_layer: bool = False


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
      load_gguf: ``(path, target cfg, dtype) -> (cfg, params)`` of a GGUF drafter file.
      per_layer: its draft layers may be held per layer (``models.dense.unstack_layers``).
    """

    architecture: str
    parse_hf: Callable[[Mapping[str, Any], str], Any]
    model: ModuleType
    load_hf: Callable[..., tuple[Any, dict]]
    gguf_architectures: tuple[str, ...] = ()
    load_gguf: Callable[..., tuple[Any, dict]] | None = None
    per_layer: bool = False


def _laguna_gguf(path, dtype, use_cache, as_numpy):
    return laguna_gguf.load_laguna_gguf_target(path, dtype, as_numpy=as_numpy)  # no weight cache: converted on the fly


def _no_gguf(name: str):
    """The GGUF loader of a family without one yet: raises DFlashError naming it."""
    def refuse(path, *args, **kwargs):
        raise DFlashError(str(path), f"a {name} GGUF (not supported yet)", "the HF safetensors folder of this model")
    return refuse


def _gguf_config(build):
    return lambda path, dtype: build(gguf_file.open_gguf(path), str(path), dtype)[0]


TARGET_FAMILIES: tuple[TargetFamily, ...] = (
    TargetFamily(
        name="dense", config_type=dense_config.TargetConfig, hf_architectures=tuple(dense_config.HF_ARCHITECTURES),
        hf_model_types=tuple(dense_config.HF_MODEL_TYPES), gguf_architectures=gguf.ARCHITECTURES,
        parse_hf=dense_config.target_config_from_hf, model=FamilyModel.of_module(dense), load_hf=hf.load_hf_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: gguf.load_gguf_target(path, dtype, use_cache=use_cache, as_numpy=as_numpy),
        gguf_config=_gguf_config(gguf.gguf_config), per_layer=True,
    ),
    TargetFamily(
        name="laguna", config_type=config_laguna.LagunaConfig, hf_architectures=("LagunaForCausalLM",),
        hf_model_types=("laguna",), gguf_architectures=(laguna_gguf.ARCH,), parse_hf=config_laguna.laguna_config_from_hf,
        model=FamilyModel.of_module(laguna_model), load_hf=laguna.load_laguna_target, load_gguf=_laguna_gguf,
        gguf_config=_gguf_config(laguna_gguf.laguna_gguf_config),
    ),
    TargetFamily(
        name="qwen3_moe", config_type=config_qwen3_moe.Qwen3MoeConfig, hf_architectures=("Qwen3MoeForCausalLM",),
        hf_model_types=("qwen3_moe",), gguf_architectures=(qwen3_moe_gguf.ARCH,), parse_hf=config_qwen3_moe.qwen3_moe_config_from_hf,
        model=FamilyModel.of_module(qwen3_moe_model), load_hf=qwen3_moe_io.load_qwen3_moe_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: qwen3_moe_gguf.load_qwen3_moe_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(qwen3_moe_gguf.qwen3_moe_gguf_config),
    ),
    TargetFamily(
        name="gpt_oss", config_type=config_gpt_oss.GptOssConfig, hf_architectures=("GptOssForCausalLM",),
        hf_model_types=("gpt_oss",), gguf_architectures=(gpt_oss_gguf.ARCH,), parse_hf=config_gpt_oss.gpt_oss_config_from_hf,
        model=FamilyModel.of_module(gpt_oss_model), load_hf=gpt_oss_io.load_gpt_oss_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: gpt_oss_gguf.load_gpt_oss_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(gpt_oss_gguf.gpt_oss_gguf_config),
    ),
    # hybrid (Gated DeltaNet + gated full attention), Qwen3.5-MoE and Qwen3-Next; the verify hooks: models/qwen3_5.py
    TargetFamily(
        name="qwen3_5", config_type=config_qwen3_5.Qwen3_5Config, hf_architectures=config_qwen3_5.HF_ARCHITECTURES,
        hf_model_types=config_qwen3_5.HF_MODEL_TYPES, gguf_architectures=tuple(qwen3_5_gguf.ARCHS),
        parse_hf=config_qwen3_5.qwen3_5_config_from_hf, model=FamilyModel.of_module(qwen3_5_model), load_hf=qwen3_5_io.load_qwen3_5_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: qwen3_5_gguf.load_qwen3_5_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(qwen3_5_gguf.qwen3_5_gguf_config),
    ),
    # Gemma 4 text, and Gemma4ForConditionalGeneration's text decoder (sliding/full layers of their own head sizes,
    # per-layer inputs, KV sharing, k_eq_v, MoE, logit soft-cap); HF and GGUF
    TargetFamily(
        name="gemma4", config_type=config_gemma4.Gemma4Config, hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
        hf_model_types=("gemma4_text",), gguf_architectures=(gemma4_gguf.ARCH,), parse_hf=config_gemma4.gemma4_config_from_hf,
        model=FamilyModel.of_module(gemma4_model), load_hf=gemma4_io.load_gemma4_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: gemma4_gguf.load_gemma4_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(gemma4_gguf.gemma4_gguf_config),
    ),
)

DRAFTER_KINDS: tuple[DrafterKind, ...] = (
    DrafterKind(architecture=drafter_config.DFLASH_DRAFTER, parse_hf=drafter_config.dflash_drafter_config_from_hf, model=dflash_drafter,
                load_hf=io_drafter.load_dflash_drafter_weights, per_layer=True),
    DrafterKind(architecture=drafter_config.LAGUNA_DRAFTER, parse_hf=config_laguna.laguna_drafter_config_from_hf, model=laguna_drafter_model,
                load_hf=laguna_drafter.load_laguna_drafter_safetensors, gguf_architectures=("dflash-draft", "dflash"),
                load_gguf=laguna_drafter.load_laguna_drafter_gguf),
)

# recognised and refused by name, with the reason
REFUSED_DRAFTERS = {
    "DFlash2DraftModel": "DFlash 2 drafters (grouped dynamic convolutions and a candidate selector) are not supported",
}


# ----------------------------------------------------------------------------------- targets


def family_of(cfg) -> TargetFamily:
    """The family of a target config (by its type). Raises DFlashError for an unknown type."""
    for fam in TARGET_FAMILIES:
        if isinstance(cfg, fam.config_type):
            return fam
    raise DFlashError("target config", f"type {type(cfg).__name__} has no registered family",
                      f"one of {', '.join(f.config_type.__name__ for f in TARGET_FAMILIES)}")


def module_for(cfg) -> FamilyModel:
    """The model of a target config (:class:`~dflash_jax.families.contract.FamilyModel`: ``forward_hidden``,
    ``lm_head``, ``embed``, ``init_cache``, ...; static, resolved at trace time). Raises
    DFlashError for an unknown type."""
    return family_of(cfg).model


def family_for_hf(cfg: Mapping[str, Any], source: str = "config.json") -> TargetFamily:
    """The family of a parsed target ``config.json``: an ``architectures`` entry, else (unless an
    entry names a DFlash drafter) its ``model_type``.

    Raises:
      DFlashError: no family matches (names ``source``, the field and the supported values).
    """
    archs = list(cfg.get("architectures") or [])
    for fam in TARGET_FAMILIES:
        if any(a in fam.hf_architectures for a in archs):
            return fam
    if not any(a.startswith("DFlash") for a in archs):
        for fam in TARGET_FAMILIES:
            if cfg.get("model_type") in fam.hf_model_types:
                return fam
    known = sorted(a for fam in TARGET_FAMILIES for a in fam.hf_architectures)
    raise DFlashError(f"{source}: field architectures", f"unsupported model {archs or cfg.get('model_type')!r}", f"one of {known}")


def family_for_gguf(path: str | os.PathLike) -> TargetFamily:
    """The family of a GGUF target by its ``general.architecture`` (read from the float32 cache's
    ``meta.json`` when the file has a current one: no need to parse the GGUF then).

    Raises:
      DFlashError: a missing, truncated or non-GGUF file, or an unsupported architecture.
    """
    info = gguf_cache.cache_info(str(path))
    arch = info["architecture"] if info is not None else gguf_file.architecture(path)
    for fam in TARGET_FAMILIES:
        if arch in fam.gguf_architectures:
            return fam
    known = tuple(a for fam in TARGET_FAMILIES for a in fam.gguf_architectures)
    raise DFlashError(f"{path}: metadata general.architecture", "missing" if arch is None else f"unsupported value {arch!r}", f"one of {known}")


def load_hf_target(folder: str | os.PathLike, dtype: str = "float32") -> tuple[Any, dict]:
    """``(cfg, params)`` of an HF target folder, by its family's loader (see :class:`TargetFamily`).

    Raises:
      DFlashError: an unreadable ``config.json``, an unsupported architecture, or whatever the
        family's loader finds (file and field or tensor named).
    """
    config_path = os.path.join(str(folder), "config.json")
    return family_for_hf(family_config.read_json(config_path), config_path).load_hf(folder, dtype)


def load_gguf_target(path: str | os.PathLike, dtype: str = "float32", *, use_cache: bool = True,
                     as_numpy: bool = False) -> tuple[Any, dict]:
    """``(cfg, params)`` of a GGUF target by its family's loader (arguments as
    :func:`dflash_jax.families.dense.gguf.load_gguf_target`; ``use_cache`` only where a family caches).

    Raises:
      DFlashError: as :func:`family_for_gguf` and the family's loader.
    """
    return family_for_gguf(path).load_gguf(str(path), dtype, use_cache, as_numpy)


def load_gguf_config(path: str | os.PathLike, dtype: str = "float32"):
    """The target config of a GGUF file from its metadata and tensor list only.

    Raises:
      DFlashError: as :func:`load_gguf_target` for metadata problems.
    """
    return family_for_gguf(path).gguf_config(str(path), dtype)


# ----------------------------------------------------------------------------------- drafters


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
    """A :class:`~dflash_jax.drafter.drafter_config.DrafterConfig` from a drafter ``config.json``, parsed by the
    kind its ``architectures`` names.

    Raises:
      DFlashError: an unsupported architecture (DFlash 2 refused by name) or whatever the kind's
        parser finds (``source`` and the field named).
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
        if cfg.architecture == drafter_config.DFLASH_DRAFTER:  # z-lab's Gemma knobs, restated against the family
            cfg = drafter_knobs.knobs_through_family(cfg, target_cfg, config_path)
    return drafter_kind(cfg.architecture).load_hf(folder, cfg, target)


def load_gguf_drafter(path: str | os.PathLike, target_cfg, dtype: str = "float32") -> tuple[Any, dict]:
    """Loads a drafter ``.gguf`` file as ``(DrafterConfig, params)`` by the kind its
    ``general.architecture`` names (``dflash-draft`` / ``dflash``: Laguna drafters).

    Raises:
      DFlashError: a file of no registered drafter kind, or whatever the kind's loader finds
        (the drafter must fit ``target_cfg``).
    """
    arch = gguf_file.architecture(path)
    for kind in DRAFTER_KINDS:
        if arch in kind.gguf_architectures:
            return kind.load_gguf(path, target_cfg, dtype)
    known = tuple(a for k in DRAFTER_KINDS for a in k.gguf_architectures)
    raise DFlashError(f"{path}: key general.architecture", f"got {arch!r}", f"one of {known} (a DFlash drafter GGUF)")
