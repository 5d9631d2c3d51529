"""Loading a target and a drafter: :func:`load_target`, :func:`load_drafter`, :func:`shipped_drafter`.

A target is a Hugging Face folder (``config.json`` + safetensors) or a ``.gguf`` file; a drafter
is a z-lab DFlash folder or a Laguna drafter ``.gguf`` file. Which config parser, model module and
weight loader a checkpoint needs is looked up by architecture in :mod:`dflash_jax.families.registry`.
:mod:`dflash_jax` re-exports these names.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any
import jax
import jax.numpy as jnp
from dflash_jax.drafter import vocab as dv
from dflash_jax import progress
from dflash_jax.families import registry
from dflash_jax.runtime import sharding
from dflash_jax.families.dense.config import TargetConfig
from dflash_jax.families.hf_config import read_json
from dflash_jax.errors import DFlashError
from dflash_jax.runtime.compiled import enable_compile_cache
from dflash_jax.runtime.fingerprint import weights_fingerprint
from dflash_jax.families.dense import gguf_cache
from dflash_jax.formats import gguf_file
from dflash_jax.formats.tokenizer import Tokenizer
from dflash_jax.nn.params import unstack_layers
from dflash_jax.drafter import model as drafter_model
from dflash_jax.nn.params import is_per_layer
from dflash_jax.nn import params as layouts
from dflash_jax.nn.params import stack_layers
from dflash_jax.nn.quant import is_quantized
from dflash_jax import weights_choice
from dflash_jax.decode.auto.policy import Calibration


DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A loaded target model.

    Attributes:
      cfg: static :class:`~dflash_jax.families.dense.config.TargetConfig` or
        :class:`~dflash_jax.families.laguna.config.LagunaConfig` (its ``dtype`` is the compute dtype).
      params: parameter pytree of :mod:`dflash_jax.families.dense.model` (layers stacked, or per layer
        on CPU: :func:`load_target`'s ``layers``) or ``models.laguna``.
      tokenizer: :class:`~dflash_jax.formats.tokenizer.Tokenizer`, or ``None`` (ids only).
      source: the file or folder it was loaded from.
      eos_ids: end-of-generation token ids (from the tokenizer, else from ``config.json`` /
        ``generation_config.json``).
      fingerprint: the fingerprint of the weights (:mod:`dflash_jax.runtime.fingerprint`) when it came
        for free (a GGUF's float32 cache records it); ``None``: computed when needed
        (:func:`fingerprint_of`).
      mesh: the :class:`jax.sharding.Mesh` its parameters are laid out on (and its drafter's,
        and every decode state's), or ``None``: one device.
      weights: how its weights are held, as :func:`load_target` resolved its ``weights``:
        ``"quantized"`` (a quantized checkpoint's weights kept as
        :class:`~dflash_jax.nn.quant.QuantizedWeight`), ``"float"`` or ``"int8"``.

    Made from them:
      model: the target as a Flax NNX module (its family's
        :class:`~dflash_jax.families.module.TargetModule` subclass, :mod:`dflash_jax.nn.module`):
        one ``nnx.Param`` per leaf of :attr:`params`, the same buffers, each with its logical axes
        as ``out_sharding`` metadata. Built (and flax imported) the first time it is read.
    """

    cfg: TargetConfig
    params: Any
    tokenizer: Any = None
    source: str = ""
    eos_ids: tuple[int, ...] = ()
    fingerprint: str | None = None
    mesh: Any = None
    weights: str = "float"

    @functools.cached_property
    def model(self):
        from dflash_jax.families.module import TargetModule

        family = registry.module_for(self.cfg)
        axes = layouts.with_wide_axes(_axes(family, self.cfg, self.params), self.params)
        return TargetModule.of(family, self.cfg, self.params, axes)

    def state(self):
        """The weights the decode steps take (``Params.target``), read anew for each generation:
        ``nnx.state(self.model)`` once :attr:`model` has been read, so a module changed in place
        (``set_value``, an optimizer step) is what runs; until then :attr:`params`, the same
        buffers (the command line and a server never read it: they import no flax)."""
        return _state(self)


def _state(model_holder):
    if "model" not in vars(model_holder):
        return model_holder.params
    from flax import nnx

    return nnx.state(model_holder.model)


LAYER_LAYOUTS = ("auto", "stacked", "per_layer")


def _per_layer(layers: str) -> bool:
    """Whether a ``layers`` choice of :func:`load_target`/:func:`load_drafter` means per-layer
    buffers here (``"auto"``: on the CPU backend). Raises DFlashError naming an unknown layout."""
    if layers not in LAYER_LAYOUTS:
        raise DFlashError("layers", f"unsupported value {layers!r}", f"one of {', '.join(LAYER_LAYOUTS)}")
    return layers == "per_layer" or (layers == "auto" and jax.default_backend() == "cpu")


def load_target(path: str | os.PathLike | None = None, dtype: str = "float32", layers: str = "auto", mesh=None,
                weights: str = "auto") -> Target:
    """Loads a target model with its tokenizer, after turning on JAX's persistent compilation cache
    (:func:`dflash_jax.runtime.compiled.enable_compile_cache`).

    Args:
      path: ``None`` for the embedded default (SmolLM2-135M-Instruct, fetched on first use, see
        :mod:`dflash_jax.assets.default_model`); a Hugging Face folder holding ``config.json`` (tokenizer loaded
        when ``tokenizer.json`` is present); or a ``.gguf`` file (tokenizer from its metadata).
      dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
      layers: layout of a dense target's decoder layers: ``"stacked"`` (one array per weight
        with a leading layer axis, run with ``lax.scan``), ``"per_layer"`` (a ``PerLayer`` of per-layer
        dicts, run as a Python loop: XLA:CPU copies each stacked layer's weights in every scan
        step; :func:`dflash_jax.nn.params.unstack_layers`) or ``"auto"`` (per layer on the CPU
        backend, stacked elsewhere). Same values and outputs either way; Laguna targets are always
        stacked. On the CPU backend a dense target also holds the ``[out, in]`` copies of
        :data:`dflash_jax.nn.params.CPU_KINDS` for passes of several rows.
      mesh: ``None`` (one device), a :class:`jax.sharding.Mesh` or ``"data=D,model=M,expert=E"``
        (:func:`dflash_jax.runtime.sharding.parse_mesh`): the parameters are laid out on it by their
        logical axes (:mod:`dflash_jax.runtime.sharding`: heads, MLP width and vocabulary split over
        ``model``, experts over ``expert``), and so are a drafter loaded for it and the decode
        states of :func:`dflash_jax.generate` and the server (rows over ``data``).
      weights: ``"quantized"`` keeps a quantized checkpoint's weights quantized (GGUF block types,
        :mod:`dflash_jax.nn.quant`; no float cache is written), ``"float"`` dequantizes them (a
        GGUF's float32 cache beside the file), ``"int8"`` quantizes a float checkpoint's weights
        to int8 on load, ``"auto"`` (default) is :func:`dflash_jax.weights_choice.resolve`'s rule
        (docs/models.md, "Quantized weights"). :attr:`Target.weights` records the choice made.
    Returns:
      :class:`Target`.
    Raises:
      DFlashError: an unsupported dtype, layout or weights choice (or one the checkpoint's family
        cannot load), a path that does not exist or is neither kind, or any problem the loaders
        find (the message names the file).
    """
    enable_compile_cache()  # before anything compiles: a second run reads its programs back
    if str(dtype) not in DTYPES:
        raise DFlashError("dtype (--dtype)", f"unsupported value {dtype!r}", f"one of {', '.join(DTYPES)}")
    per_layer = _per_layer(layers)
    weights_choice.check(weights)
    mesh = None if mesh is None else sharding.parse_mesh(mesh)
    if path is None:
        from dflash_jax.assets.default_model import default_target_path

        p = default_target_path()
        try:
            return load_target(p, dtype=dtype, layers=layers, mesh=mesh, weights=weights)
        except DFlashError as e:  # a damaged cached copy (e.g. an interrupted extraction)
            hint = f"delete {p} so that it is fetched again"
            raise DFlashError(e.where, e.what, f"{e.expected}; the cached default model looks damaged: {hint}" if e.expected else hint) from e
    p = Path(path).expanduser()
    with progress.step(f"loading {p}", f"loaded the target {p.name} ({dtype})", routine=True):
        with gguf_file.shared_readers():  # the registry, the weights and the tokenizer parse a GGUF once
            weights = weights_choice.resolve(weights, p, dtype, can_quantize=lambda: registry.keeps_quantized(p))
            cfg, params, tok, eos = _read_target(p, dtype, weights)
        if tok is not None and tok.vocab_size > cfg.vocab_size:
            raise DFlashError(f"{p}: tokenizer", f"{tok.vocab_size} ids but the embedding has {cfg.vocab_size} rows",
                              "a tokenizer no larger than the embedding")
        if per_layer and registry.module_for(cfg).per_layer:
            params = unstack_layers(params)  # numpy views of a GGUF's cache: no copy
        elif not per_layer and is_per_layer(params.get("layers")):
            params = _stacked_if_uniform(params)  # a quantized loader's layers, stacked where their types agree
        params = with_output_head(jax.device_put(params))
        if registry.module_for(cfg).per_layer and jax.default_backend() == "cpu":  # dense targets on XLA:CPU
            params = layouts.with_wide_layouts(params, layouts.CPU_KINDS, tied=cfg.tie_word_embeddings)
        if mesh is not None:
            params = sharding.shard_params(params, _axes(registry.module_for(cfg), cfg, params), mesh)
    info = gguf_cache.cache_info(str(p)) if p.is_file() else None
    return Target(cfg=cfg, params=params, tokenizer=tok, source=str(p), eos_ids=eos,
                  fingerprint=None if info is None else info.get("fingerprint"), mesh=mesh, weights=weights)


def _stacked_if_uniform(params: dict) -> dict:
    """``params`` with its per-layer ``layers`` stacked, or as they are when the layers differ in
    structure (a Q4_K_M file quantizes some layers' tensors with other types: they run per layer)."""
    layers = list(params["layers"])
    first = jax.tree_util.tree_structure(layers[0])
    shapes = [tuple(a.shape for a in jax.tree_util.tree_leaves(lp)) for lp in layers]
    if any(jax.tree_util.tree_structure(lp) != first for lp in layers) or len(set(shapes)) != 1:
        return params
    return stack_layers(params)


def _axes(module, cfg, params) -> dict:
    """``module.param_axes`` of ``params``' layout (per-layer decoder layers or stacked)."""
    if is_per_layer(params.get("layers")):
        return module.param_axes(cfg, per_layer=True)
    return module.param_axes(cfg)


def _read_target(p: Path, dtype: str, weights: str = "float"):
    """``(cfg, params, tokenizer or None, eos ids)`` of an HF folder or a ``.gguf`` file, by the
    family :mod:`dflash_jax.families.registry` finds for it, ``weights`` resolved (a GGUF's float
    params are numpy arrays: float32 ones memory-mapped from its cache, which ``jax.device_put`` on
    the CPU uses without a copy; quantized ones are moved to the device tensor by tensor)."""
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DFlashError(str(p), "folder has no config.json", "a Hugging Face checkpoint folder or a .gguf file")
        cfg, params = registry.load_hf_target(p, dtype=dtype, weights=weights)
        tok = Tokenizer.from_hf_folder(p) if (p / "tokenizer.json").is_file() else None
        return cfg, params, tok, tuple(tok.eos_token_ids) if tok is not None else _hf_eos_ids(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        if weights == "float":
            cfg, params = registry.load_gguf_target(p, dtype=dtype, as_numpy=True)
            tok = Tokenizer.from_gguf(p)
        else:  # the tokenizer first, then its parsed lists freed: they and the weights do not add up
            tok = Tokenizer.from_gguf(p)
            gguf_file.drop_token_lists(gguf_file.open_gguf(p))
            cfg, params = registry.load_gguf_target(p, dtype=dtype, weights=weights)
        return cfg, params, tok, tuple(tok.eos_token_ids)
    if not p.exists():
        raise DFlashError(str(p), "no such file or folder", "a Hugging Face checkpoint folder or a .gguf file")
    raise DFlashError(str(p), "not a folder and not a .gguf file", "a Hugging Face checkpoint folder or a .gguf file")


def with_output_head(params: dict) -> dict:
    """Adds an ``[H, V]`` copy of a tied embedding as ``lm_head`` (a layout choice, same values).

    The models use ``params["lm_head"]`` when present; a stored ``[H, V]`` head multiplies about
    twice as fast on CPU as the transposed ``[V, H]`` embedding (measured in BENCHMARKS.md's notes).
    A quantized embedding gets no float copy: the model's head multiplies it as it is
    (:func:`dflash_jax.nn.layer.lm_head`).
    """
    if "lm_head" in params or is_quantized(params["embed"]):
        return params
    return dict(params, lm_head=jnp.asarray(jnp.transpose(params["embed"])))


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
    """A loaded DFlash drafter.

    Attributes:
      cfg: static :class:`~dflash_jax.drafter.config.DrafterConfig`.
      params: parameter pytree of :mod:`dflash_jax.drafter.model`.
      source: the folder or file it was loaded from.
      n_max: the draft depth recorded with the checkpoint (``config.json`` field
        ``dflash_jax.n_max``: the best fixed depth its benchmark measured, or ``"auto"``), used
        when :func:`generate` is given none; ``None``: ``block_size - 1``.
      calibration: the per-position calibration of its confidences for ``n_max="auto"``
        (``config.json`` field ``dflash_jax.depth_calibration``,
        :class:`~dflash_jax.decode.auto.policy.Calibration`), or ``None`` (raw confidences).
      auto_depth: the drafts per block under ``n_max="auto"`` (``config.json`` field
        ``dflash_jax.auto_depth``: what its benchmark measured best; ``None``: ``block_size - 1``;
        :attr:`dflash_jax.decode.state.Decoding.auto_depth`). ``dataclasses.replace(drafter,
        auto_depth=k)`` runs auto over another depth.
      tree: the nodes of the best-first draft tree verified with its recorded depth
        (``config.json`` field ``dflash_jax.tree``, :attr:`dflash_jax.decode.state.Decoding.tree`;
        ``None``: a chain of drafts).
      model: made from ``params``: the drafter as a Flax NNX module (its kind's
        :class:`~dflash_jax.drafter.module.DrafterModule` subclass) over the same buffers, built
        the first time it is read (:attr:`Target.model`).
    """

    cfg: Any
    params: Any
    source: str = ""
    n_max: int | str | None = None
    calibration: Any = None
    auto_depth: int | None = None
    tree: int | None = None
    weights: str = "float"

    @functools.cached_property
    def model(self):
        from dflash_jax.drafter.module import DrafterModule

        return DrafterModule.of(self.cfg, self.params, _axes(drafter_model, self.cfg, self.params))

    def state(self):
        """The weights the decode steps take (``Params.drafter``), as :meth:`Target.state`."""
        return _state(self)


def load_drafter(path: str | os.PathLike, target: Target, dtype: str | None = None, draft_vocab: bool = True,
                 layers: str = "auto", weights: str | None = None) -> Drafter:
    """Loads a DFlash drafter for ``target`` (z-lab folder, or a Laguna drafter GGUF file).

    Args:
      path: drafter checkpoint folder (``config.json`` + safetensors) or ``.gguf`` file.
      target: the target it drafts for; the drafter is checked against it.
      dtype: parameter dtype (default: the target's).
      draft_vocab: draft over the reduced vocabulary stored with the checkpoint
        (``draft_vocab.safetensors``, :mod:`dflash_jax.drafter.vocab`) when there is one;
        ``False`` drafts over the target's whole vocabulary.
      layers: layout of the draft layers, as :func:`load_target`'s ``layers`` (``"auto"``: per
        layer on the CPU backend, where a scan copied both layers' weights, about 28 MB, in every
        propose); Laguna drafters are always stacked.
      weights: as :func:`load_target`'s; ``None`` follows the target's choice
        (:attr:`Target.weights`) where the drafter's loader can (a float drafter checkpoint stays
        float under ``"quantized"``). :attr:`Drafter.weights` records the choice made.
    The parameters are laid out on the target's mesh when it has one (:attr:`Target.mesh`).

    Raises:
      DFlashError: a missing path, bad config fields, tensors, or a drafter that does not fit
        the target (the message names the file and field); an unsupported layout.
    """
    per_layer = _per_layer(layers)
    p = Path(path).expanduser()
    dtype = dtype or target.cfg.dtype
    explicit = weights is not None
    weights = weights_choice.check(weights or target.weights)
    if p.is_file() and p.suffix.lower() == ".gguf":
        load, weights = weights_choice.loader(drafter_model.load_gguf_drafter, weights, explicit, p, dtype)
        cfg, params = load(p, target.cfg, dtype=dtype)
        n_max = auto_depth = calibration = tree = None
    elif p.is_dir():
        load, weights = weights_choice.loader(drafter_model.load_hf_drafter, weights, explicit, p, dtype)
        cfg, params = load(p, target.cfg, dtype=dtype)
        n_max, auto_depth, calibration, tree = _recorded_policy(p / "config.json", cfg.block_size)
        ids = dv.load(p, cfg.vocab_size) if draft_vocab else None
        if ids is not None:
            cfg, params = dv.attach(cfg, params, target.params, ids)
    elif p.exists():
        raise DFlashError(str(p), "exists but is neither a folder nor a .gguf file",
                          "a DFlash drafter checkpoint folder (config.json + safetensors) or a drafter .gguf file")
    else:
        raise DFlashError(str(p), "no such folder or .gguf file", "a DFlash drafter checkpoint")
    if per_layer and drafter_model.drafter_kind(cfg.architecture).per_layer:
        params = unstack_layers(params)
    if target.mesh is not None:
        params = sharding.shard_params(params, _axes(drafter_model, cfg, params), target.mesh)
    return Drafter(cfg=cfg, params=params, source=str(p), n_max=n_max, calibration=calibration, auto_depth=auto_depth, tree=tree,
                   weights=weights)


def _recorded_policy(config_path: Path, block_size: int):
    """``(n_max, auto_depth, calibration, tree)`` recorded in a drafter ``config.json``:
    ``dflash_jax.n_max`` (an integer in ``[1, block_size - 1]`` or ``"auto"``),
    ``dflash_jax.auto_depth`` (an integer in ``[1, block_size - 1]``),
    ``dflash_jax.depth_calibration`` and ``dflash_jax.tree`` (an integer in
    ``[1, MAX_TREE_NODES]``; raises ``DFlashError`` naming the file and field otherwise)."""
    from dflash_jax.decode.state import MAX_TREE_NODES

    record = read_json(config_path).get("dflash_jax") or {}
    value, auto_depth = record.get("n_max"), record.get("auto_depth")
    if value is not None and value != "auto" and not _depth_ok(value, block_size):
        raise DFlashError(f"{config_path}: field dflash_jax.n_max", f"got {value!r}", f"an integer in [1, {block_size - 1}] (block_size - 1) or 'auto'")
    if auto_depth is not None and not _depth_ok(auto_depth, block_size):
        raise DFlashError(f"{config_path}: field dflash_jax.auto_depth", f"got {auto_depth!r}", f"an integer in [1, {block_size - 1}] (block_size - 1)")
    calibration = record.get("depth_calibration")
    if calibration is not None:
        calibration = Calibration.from_record(calibration, block_size - 1, f"{config_path}: field dflash_jax.depth_calibration")
    tree = record.get("tree")
    if tree is not None and not _depth_ok(tree, MAX_TREE_NODES + 1):
        raise DFlashError(f"{config_path}: field dflash_jax.tree", f"got {tree!r}", f"an integer in [1, {MAX_TREE_NODES}] (drafted nodes per step)")
    return value, auto_depth, calibration, tree


def _depth_ok(value, block_size: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value < block_size


def fingerprint_of(target: Target) -> str:
    """The fingerprint of ``target``'s weights (:func:`dflash_jax.runtime.fingerprint.weights_fingerprint`):
    ``target.fingerprint`` when its loader recorded one, else computed from ``target.params``
    (which equals the float32 weights' fingerprint when the target was loaded in float32, or its
    checkpoint stores the weights in the loaded dtype)."""
    return target.fingerprint or weights_fingerprint(target.cfg, target.params)


def shipped_drafter_path(target: Target) -> Path | None:
    """The folder of the drafter shipped for ``target`` (:func:`dflash_jax.assets.default_model.shipped_drafters`),
    matched by the fingerprint of the target's weights, not by its file name: a renamed or
    re-saved copy of the same weights finds it, another model under the same name does not.
    ``None`` when none ships. The fingerprint is computed only for a target of a shipped
    drafter's shape (layers, hidden size, vocabulary)."""
    from dflash_jax.assets.default_model import shipped_drafters

    cfg = target.cfg
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    candidates = [d for d in shipped_drafters() if d.target_shape == shape]
    if not candidates:
        return None
    fp = fingerprint_of(target)
    return next((d.folder for d in candidates if d.target_fingerprint == fp), None)


def shipped_drafter(target: Target, dtype: str | None = None) -> Drafter | None:
    """The drafter shipped inside the package for ``target`` (:func:`shipped_drafter_path`), loaded,
    or ``None`` if there is none."""
    folder = shipped_drafter_path(target)
    if folder is None:
        return None
    with progress.step(f"loading the shipped drafter {folder.name}", f"loaded the shipped drafter {folder.name}", routine=True):
        return load_drafter(folder, target, dtype)


def _hf_eos_ids(folder: Path) -> tuple[int, ...]:
    """``eos_token_id`` (int or list) of ``generation_config.json``, else of ``config.json``."""
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        if f.is_file():
            v = read_json(f).get("eos_token_id")
            if v is not None:
                return tuple(int(i) for i in (v if isinstance(v, list) else [v]))
    return ()
