"""Target families, keyed by architecture: the one place that knows them.

A :class:`TargetFamily` names a target's Hugging Face ``architectures`` / ``model_type`` and GGUF
``general.architecture`` values, its config type and parser, its model as a
:class:`~dflash_jax.families.contract.FamilyModel` (the typed contract every caller uses: ``embed``,
``forward_hidden``, ``lm_head``, ``init_cache``, ``param_axes``, ... and its declared capabilities)
and its HF and GGUF loaders. Every other module asks here (:func:`module_for`, :func:`family_for_hf`,
:func:`load_hf_target`, ...); adding a family is one entry in :data:`TARGET_FAMILIES`. The DFlash
drafter kinds have their own table, :mod:`dflash_jax.drafter.model`.

Nothing this module imports may import it back (``tests/test_architecture.py`` fails on a cycle):
the modules registered here are the ones below it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping
from dflash_jax.families import hf_config as family_config
from dflash_jax.families.dense import config as dense_config
from dflash_jax.families.gemma4 import config as config_gemma4
from dflash_jax.families.gpt_oss import config as config_gpt_oss
from dflash_jax.families.laguna import config as config_laguna
from dflash_jax.families.qwen3_5 import config as config_qwen3_5
from dflash_jax.families.qwen3_moe import config as config_qwen3_moe
from dflash_jax.errors import DFlashError
from dflash_jax.families.contract import FamilyModel
from dflash_jax.families.dense import gguf, gguf_cache, gguf_quantized
from dflash_jax import weights_choice
from dflash_jax.formats import gguf_file
from dflash_jax.families.dense import safetensors as hf
from dflash_jax.families.laguna import safetensors as laguna, gguf as laguna_gguf
from dflash_jax.families.gemma4 import safetensors as gemma4_io
from dflash_jax.families.gpt_oss import safetensors as gpt_oss_io
from dflash_jax.families.qwen3_5 import safetensors as qwen3_5_io
from dflash_jax.families.qwen3_moe import safetensors as qwen3_moe_io
from dflash_jax.families.gemma4 import gguf as gemma4_gguf
from dflash_jax.families.gpt_oss import gguf as gpt_oss_gguf
from dflash_jax.families.qwen3_5 import gguf as qwen3_5_gguf
from dflash_jax.families.qwen3_moe import gguf as qwen3_moe_gguf
from dflash_jax.families.dense import model as dense
from dflash_jax.families.gemma4 import model as gemma4_model
from dflash_jax.families.gpt_oss import model as gpt_oss_model
from dflash_jax.families.laguna import model as laguna_model
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
        ``init_cache``, ...; the capabilities ``paged_kv``, ``trees``, ``recurrent_state``,
        ``per_layer``), the family model module's ``MODEL``, checked against the contract when built.
      load_hf: ``(folder, dtype) -> (cfg, params)``.
      load_gguf: ``(path, dtype, use_cache, as_numpy) -> (cfg, params)``; one that also takes a
        ``weights`` keyword (``"quantized"``, ``"int8"``; :mod:`dflash_jax.weights_choice`) loads
        those too (so may ``load_hf``).
      gguf_config: ``(path, dtype) -> cfg`` from the GGUF's metadata and tensor list only.
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


def _laguna_gguf(path, dtype, use_cache, as_numpy):
    return laguna_gguf.load_laguna_gguf_target(path, dtype, as_numpy=as_numpy)  # no weight cache: converted on the fly


def _dense_gguf(path, dtype, use_cache, as_numpy, weights="float"):
    if weights == "quantized":
        return gguf_quantized.load_quantized_gguf_target(path, dtype, as_numpy=as_numpy)
    if weights == "int8":
        raise DFlashError("weights (--weights)", f"'int8' for the GGUF file {path} (its weights are quantized already)", "quantized or float")
    return gguf.load_gguf_target(path, dtype, use_cache=use_cache, as_numpy=as_numpy)


def _gguf_config(build):
    return lambda path, dtype: build(gguf_file.open_gguf(path), str(path), dtype)[0]


TARGET_FAMILIES: tuple[TargetFamily, ...] = (
    TargetFamily(
        name="dense", config_type=dense_config.TargetConfig, hf_architectures=tuple(dense_config.HF_ARCHITECTURES),
        hf_model_types=tuple(dense_config.HF_MODEL_TYPES), gguf_architectures=gguf.ARCHITECTURES,
        parse_hf=dense_config.target_config_from_hf, model=dense.MODEL, load_hf=hf.load_hf_target,
        load_gguf=_dense_gguf, gguf_config=_gguf_config(gguf.gguf_config),
    ),
    TargetFamily(
        name="laguna", config_type=config_laguna.LagunaConfig, hf_architectures=("LagunaForCausalLM",),
        hf_model_types=("laguna",), gguf_architectures=(laguna_gguf.ARCH,), parse_hf=config_laguna.laguna_config_from_hf,
        model=laguna_model.MODEL, load_hf=laguna.load_laguna_target, load_gguf=_laguna_gguf,
        gguf_config=_gguf_config(laguna_gguf.laguna_gguf_config),
    ),
    TargetFamily(
        name="qwen3_moe", config_type=config_qwen3_moe.Qwen3MoeConfig, hf_architectures=("Qwen3MoeForCausalLM",),
        hf_model_types=("qwen3_moe",), gguf_architectures=(qwen3_moe_gguf.ARCH,), parse_hf=config_qwen3_moe.qwen3_moe_config_from_hf,
        model=qwen3_moe_model.MODEL, load_hf=qwen3_moe_io.load_qwen3_moe_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: qwen3_moe_gguf.load_qwen3_moe_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(qwen3_moe_gguf.qwen3_moe_gguf_config),
    ),
    TargetFamily(
        name="gpt_oss", config_type=config_gpt_oss.GptOssConfig, hf_architectures=("GptOssForCausalLM",),
        hf_model_types=("gpt_oss",), gguf_architectures=(gpt_oss_gguf.ARCH,), parse_hf=config_gpt_oss.gpt_oss_config_from_hf,
        model=gpt_oss_model.MODEL, load_hf=gpt_oss_io.load_gpt_oss_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: gpt_oss_gguf.load_gpt_oss_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(gpt_oss_gguf.gpt_oss_gguf_config),
    ),
    # hybrid (Gated DeltaNet + gated full attention), Qwen3.5-MoE and Qwen3-Next; the verify hooks: families/qwen3_5/model.py
    TargetFamily(
        name="qwen3_5", config_type=config_qwen3_5.Qwen3_5Config, hf_architectures=config_qwen3_5.HF_ARCHITECTURES,
        hf_model_types=config_qwen3_5.HF_MODEL_TYPES, gguf_architectures=tuple(qwen3_5_gguf.ARCHS),
        parse_hf=config_qwen3_5.qwen3_5_config_from_hf, model=qwen3_5_model.MODEL, load_hf=qwen3_5_io.load_qwen3_5_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: qwen3_5_gguf.load_qwen3_5_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(qwen3_5_gguf.qwen3_5_gguf_config),
    ),
    # Gemma 4 text, and Gemma4ForConditionalGeneration's text decoder (sliding/full layers of their own head sizes,
    # per-layer inputs, KV sharing, k_eq_v, MoE, logit soft-cap); HF and GGUF
    TargetFamily(
        name="gemma4", config_type=config_gemma4.Gemma4Config, hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
        hf_model_types=("gemma4_text",), gguf_architectures=(gemma4_gguf.ARCH,), parse_hf=config_gemma4.gemma4_config_from_hf,
        model=gemma4_model.MODEL, load_hf=gemma4_io.load_gemma4_target,
        load_gguf=lambda path, dtype, use_cache, as_numpy: gemma4_gguf.load_gemma4_gguf_target(path, dtype, as_numpy=as_numpy),
        gguf_config=_gguf_config(gemma4_gguf.gemma4_gguf_config),
    ),
)

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


def load_hf_target(folder: str | os.PathLike, dtype: str = "float32", weights: str = "float") -> tuple[Any, dict]:
    """``(cfg, params)`` of an HF target folder, by its family's loader (see :class:`TargetFamily`);
    ``weights`` (``"float"``, ``"quantized"``, ``"int8"``: :mod:`dflash_jax.weights_choice`) other
    than float is passed to a loader that takes a ``weights`` keyword.

    Raises:
      DFlashError: an unreadable ``config.json``, an unsupported architecture, a ``weights``
        choice the family's loader does not take, or whatever the loader finds (file and field
        or tensor named).
    """
    config_path = os.path.join(str(folder), "config.json")
    fam = family_for_hf(family_config.read_json(config_path), config_path)
    if weights == "float":
        return fam.load_hf(folder, dtype)
    _check_weights(fam, fam.load_hf, weights, str(folder))
    return fam.load_hf(folder, dtype, weights=weights)


def load_gguf_target(path: str | os.PathLike, dtype: str = "float32", *, use_cache: bool = True,
                     as_numpy: bool = False, weights: str = "float") -> tuple[Any, dict]:
    """``(cfg, params)`` of a GGUF target by its family's loader (arguments as
    :func:`dflash_jax.families.dense.gguf.load_gguf_target`; ``use_cache`` only where a family
    caches; ``weights`` as :func:`load_hf_target`'s: ``"quantized"`` keeps the file's quantized
    tensors quantized where the family's ``load_gguf`` takes a ``weights`` keyword).

    Raises:
      DFlashError: as :func:`family_for_gguf` and the family's loader; a ``weights`` choice the
        family's loader does not take.
    """
    fam = family_for_gguf(path)
    if weights == "float":
        return fam.load_gguf(str(path), dtype, use_cache, as_numpy)
    _check_weights(fam, fam.load_gguf, weights, str(path))
    return fam.load_gguf(str(path), dtype, use_cache, as_numpy, weights=weights)


def _check_weights(fam: TargetFamily, load, weights: str, where: str) -> None:
    if not weights_choice.takes_weights(load):
        raise DFlashError("weights (--weights)", f"{weights!r} is not supported for {fam.name} checkpoints ({where}) yet", "float")


def keeps_quantized(path: str | os.PathLike) -> bool:
    """Whether the family of the checkpoint ``path`` (a ``.gguf`` file or an HF folder) has a loader
    that takes a ``weights`` choice (:func:`dflash_jax.weights_choice.resolve`'s ``can_quantize``)."""
    p = str(path)
    if os.path.isdir(p):
        config_path = os.path.join(p, "config.json")
        return weights_choice.takes_weights(family_for_hf(family_config.read_json(config_path), config_path).load_hf)
    return weights_choice.takes_weights(family_for_gguf(p).load_gguf)


def load_gguf_config(path: str | os.PathLike, dtype: str = "float32"):
    """The target config of a GGUF file from its metadata and tensor list only.

    Raises:
      DFlashError: as :func:`load_gguf_target` for metadata problems.
    """
    return family_for_gguf(path).gguf_config(str(path), dtype)
