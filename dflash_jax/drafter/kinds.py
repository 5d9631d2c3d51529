"""DFlash drafter kinds, keyed by architecture: the one place that knows them.

A :class:`DrafterKind` names a drafter ``architectures`` value, its config parser, its model module
and its loaders. :mod:`dflash_jax.drafter.model` dispatches on it; loading asks here
(:func:`drafter_config_from_hf`, :func:`load_hf_drafter`, :func:`load_gguf_drafter`); adding a kind
is one entry in :data:`DRAFTER_KINDS`. A target family's model comes from
:mod:`dflash_jax.families.registry`; nothing here reaches it.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Any, Callable, Mapping
from dflash_jax.drafter import config as drafter_config
from dflash_jax.drafter import generic as dflash_drafter
from dflash_jax.drafter import knobs as drafter_knobs
from dflash_jax.drafter import laguna as laguna_drafter
from dflash_jax.errors import DFlashError
from dflash_jax.families import config as family_config
from dflash_jax.formats import gguf as gguf_file
from dflash_jax.formats.safetensors import numpy_dtype


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
)

# recognised and refused by name, with the reason
REFUSED_DRAFTERS = {
    "DFlash2DraftModel": "DFlash 2 drafters (grouped dynamic convolutions and a candidate selector) are not supported",
}



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
