"""Exact-resume training checkpoints, written with orbax-checkpoint by every process of the run.

A checkpoint folder ``step_XXXXXXXX/`` holds two orbax items: ``state`` (the parameters, the
optimizer state and the PRNG key's data, each array written by the processes that hold its
shards, OCDBT/zarr files that tensorstore reads) and ``meta`` (JSON: the step, the key's
implementation, the data cursor and the run's counters). Every process calls
:func:`save_checkpoint` at the same step; orbax writes into a temporary folder, waits for all of
them and process 0 renames it into place (atomic on a local file system), then process 0 points
``latest.json`` at it and removes the oldest beyond ``keep``. :func:`load_checkpoint` restores
each array straight into the layout of the state it is given (one device, or a device mesh of
one process or several), so a run resumes bit for bit on the same mesh; on another mesh it
resumes with the same values, and its later steps differ only by the order of float additions.

The parameters are the drafter module's ``nnx.State`` (:attr:`~dflash_jax.train.step.TrainState.params`),
and the AdamW moments states like them; they are written as their values in nested dicts
(``nnx.to_pure_dict``), the parameter tree's names, so the files are laid out as those the
trainer wrote while its parameters were plain dicts (``state/params.fc``, not the
``params.fc.value`` a ``nnx.Param`` node adds to an orbax key path): a checkpoint of either
version restores in the other, and orbax alone, without flax, restores the plain tree. Restoring
puts the values back into the template's states (their ``nnx.Param`` metadata, the logical axes,
come from the template). To load a checkpoint's weights into a loaded drafter's module (any
layer layout and dtype: :func:`dflash_jax.nn.module.set_weights`)::

    state, meta = load_checkpoint(path, init_train_state(drafter.cfg, tc))
    set_weights(drafter.model, state.params)       # drafter.model's params are now the checkpoint's

Older run folders (``params.safetensors``, ``opt_state.safetensors`` and ``state.json``, written
before the step could be sharded) are still resumed: :func:`load_checkpoint` reads them, and the
run goes on writing orbax checkpoints.

Cost against the previous safetensors writer, measured on the test drafter of
``tests/test_train.py`` (70,080 float32 parameters, 0.84 MB with the AdamW moments; the shared
2-core CPU of this machine, medians of 10 after a first call; orbax-checkpoint 0.12.8): importing
orbax and building its checkpointer takes 0.10-0.21 s after JAX (0.7-1.0 s while other tests kept
both cores busy; it is imported only when a checkpoint is written or read, never by ``generate``
or ``serve``); a save takes 45-110 ms against 3-4 ms, a restore 29-44 ms against 1.3 ms (first
restore 90-170 ms against 34 ms). At the default ``--ckpt-every 100`` that is well under 0.1% of a
run's time; what it buys is the per-process shard writes with one commit.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dflash_jax.runtime import distributed, sharding
from dflash_jax.errors import DFlashError
from dflash_jax.formats.files import write_text
from dflash_jax.train.step import TrainState

_STEP_DIR = re.compile(r"step_\d{8}")


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _is_state(x) -> bool:
    return isinstance(x, nnx.State)


def _pure(tree):
    """``tree`` with every ``nnx.State`` in it a nested dict of its values (``nnx.to_pure_dict``):
    the layout written to disk, the same arrays."""
    return jax.tree_util.tree_map(lambda x: nnx.to_pure_dict(x) if _is_state(x) else x, tree, is_leaf=_is_state)


def _like(template, pure):
    """``pure`` (a tree laid out as :func:`_pure` of ``template``) with every state of
    ``template`` back: a new ``nnx.State`` with the template's variables (their metadata) holding
    ``pure``'s values; ``template`` is not changed."""
    def one(t, p):
        if not _is_state(t):
            return p
        out = jax.tree_util.tree_map(lambda x: x, t)  # new variables
        nnx.replace_by_pure_dict(out, p)
        return out

    return jax.tree_util.tree_map(one, template, pure, is_leaf=_is_state)


def save_checkpoint(ckpt_dir: str | os.PathLike, state: TrainState, extra: dict, keep: int = 3) -> Path:
    """Writes ``step_XXXXXXXX/`` (items ``state``: params, optimizer state and PRNG key data,
    states as their values (module docstring); ``meta``: JSON of ``extra`` with ``step`` and
    ``rng_impl``) with orbax, then points
    ``latest.json`` at it and keeps the newest ``keep`` checkpoints. Every process calls it at the
    same step (each writes the shards it holds; process 0 commits). Returns the folder.

    Args:
      state: a :class:`TrainState` on one device or laid out on a mesh.
      extra: JSON-serialisable run records (data cursor, tokens seen, ...).
    """
    ocp, ckptr = _checkpointer()
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = int(distributed.fetch(state.step))
    name = f"step_{step:08d}"
    final = ckpt_dir / name
    tree = _pure({"params": state.params, "opt_state": state.opt_state, "rng": jax.random.key_data(state.rng)})
    meta = dict(extra, step=step, rng_impl=str(jax.random.key_impl(state.rng)))
    ckptr.save(final.absolute(), args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)), force=True)
    if distributed.is_leader():
        write_text(ckpt_dir / "latest.json", json.dumps({"checkpoint": name, "step": step}))
        done = sorted(p for p in ckpt_dir.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir())
        for old in done[: max(len(done) - keep, 0)]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _complete(p: Path) -> bool:
    """Whether ``p`` is a whole checkpoint: orbax's (``state/`` and its metadata file) or an older
    safetensors one (``state.json``, written last)."""
    return (p / "state.json").is_file() or ((p / "state").is_dir() and (p / "_CHECKPOINT_METADATA").is_file())


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder (``latest.json``, else the highest complete
    ``step_XXXXXXXX``), or ``None``."""
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / "latest.json"
    if latest.is_file():
        try:
            p = ckpt_dir / json.loads(latest.read_text(encoding="utf-8"))["checkpoint"]
            if _complete(p):
                return p
        except (ValueError, KeyError):
            pass
    done = sorted(p for p in ckpt_dir.glob("step_*") if _STEP_DIR.fullmatch(p.name) and _complete(p))
    return done[-1] if done else None


def _key(data, impl: str | None, like):
    """A PRNG key array of ``data`` (uint32 key data) laid out as the key ``like``."""
    return jax.jit(functools.partial(jax.random.wrap_key_data, impl=impl or None), out_shardings=like.sharding)(data)


def load_checkpoint(path: str | os.PathLike, template: TrainState) -> tuple[TrainState, dict]:
    """Restores a :class:`TrainState` shaped and laid out like ``template`` (its arrays' shapes,
    dtypes and shardings; one device or a mesh) from a checkpoint folder: orbax's (of this
    version or of the one whose params were plain dicts: the same files), or an older
    safetensors one. Every process of the run calls it.

    Args:
      template: e.g. :func:`~dflash_jax.train.step.init_train_state` of the run's drafter and
        settings (laid out on the run's mesh); only its structure, shapes, dtypes and shardings
        are read.
    Returns:
      ``(state, meta)``: ``state.params`` a new ``nnx.State`` of the drafter module (the
      template's params, metadata and all, holding the checkpoint's float32 values;
      ``set_weights(drafter.model, state.params)`` loads them into a module), ``meta`` the saved
      records (``step``, ``rng_impl``, the ``extra`` of :func:`save_checkpoint`).
    Raises:
      DFlashError: a missing or mismatched tensor (names the file or item and the tensor).
    """
    path = Path(path)
    if (path / "state.json").is_file():
        return _load_safetensors(path, template)
    ocp, ckptr = _checkpointer()
    tree = _pure({"params": template.params, "opt_state": template.opt_state, "rng": jax.random.key_data(template.rng)})
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    try:
        got = ckptr.restore(path.absolute(), args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise DFlashError(f"{path}: state", f"does not restore into this run's state ({str(e)[:300]})",
                          "a checkpoint of the same drafter and optimizer") from e
    meta, st = dict(got["meta"]), got["state"]
    params, opt = _like((template.params, template.opt_state), (st["params"], st["opt_state"]))
    step = sharding.place(np.asarray(meta["step"], np.int32), template.step.sharding)
    return TrainState(params=params, opt_state=opt, rng=_key(st["rng"], meta.get("rng_impl"), template.rng), step=step), meta


def _unflat(template, flat: dict, where: str):
    """The numpy arrays of ``flat`` (names as the safetensors writer made them) in the tree of
    ``template``, checked against its shapes and dtypes."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for p, v in leaves:
        name = jax.tree_util.keystr(p, simple=True, separator=".")
        if name not in flat:
            raise DFlashError(f"{where}: tensor {name}", "missing", "a checkpoint of the same drafter and optimizer")
        a, want = flat[name], jax.ShapeDtypeStruct(np.shape(v), v.dtype)
        if tuple(a.shape) != tuple(want.shape) or a.dtype != want.dtype:
            raise DFlashError(f"{where}: tensor {name}", f"{a.dtype}{list(a.shape)}", f"{want.dtype}{list(want.shape)}")
        out.append(a)
    return jax.tree_util.tree_unflatten(treedef, out)


def _load_safetensors(path: Path, template: TrainState) -> tuple[TrainState, dict]:
    """A checkpoint of the previous writer (``params.safetensors``, ``opt_state.safetensors``,
    ``state.json`` with step and PRNG key data; tensors named by the plain parameter tree's paths,
    ``layers.wq``, ``1.0.mu.layers.wq``), laid out like ``template``."""
    from safetensors.numpy import load_file

    meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    pure = _pure((template.params, template.opt_state))
    params = _unflat(pure[0], load_file(str(path / "params.safetensors")), str(path / "params.safetensors"))
    opt = _unflat(pure[1], load_file(str(path / "opt_state.safetensors")), str(path / "opt_state.safetensors"))
    placed = sharding.place((params, opt), jax.tree_util.tree_map(lambda x: x.sharding, pure))
    params, opt = _like((template.params, template.opt_state), placed)
    rng = _key(np.asarray(meta["rng"], np.uint32), meta.get("rng_impl"), template.rng)
    return TrainState(params=params, opt_state=opt, rng=rng, step=sharding.place(np.asarray(meta["step"], np.int32), template.step.sharding)), meta
