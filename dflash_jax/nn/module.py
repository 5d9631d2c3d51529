"""The weights of a model as a Flax NNX module, and the parameter tree the model functions read.

A loaded target or drafter is an ``nnx.Module`` (:attr:`dflash_jax.loading.Target.model`): one
``nnx.Param`` per weight of the checkpoint, named as in the parameter tree of its family
(``model.layers[3].wq``), its logical axes (:mod:`dflash_jax.runtime.sharding`) in the param's
``out_sharding`` metadata, a quantized weight (:class:`~dflash_jax.nn.quant.QuantizedWeight`)
as the value of its param. Decoder layers held per layer are an ``nnx.List`` of :class:`Layer`
modules (one buffer per layer and weight, what XLA:CPU runs fastest); stacked ones one
:class:`Layer` of ``[L, ...]`` params (one buffer per weight kind, run by ``lax.scan``).

The math stays pure functions of a parameter tree (dicts of arrays, per-layer layers a
:class:`~dflash_jax.nn.params.PerLayer`), so the jitted steps stay ``f(params, state, static)``:
``params`` holds the models' ``nnx.State`` (``nnx.state(model)``, the graph static), and a step
reads it as that tree at trace time (:func:`tree_of`), where the peers call ``nnx.merge``: the
graph holds no computation, so merging it back would give the same arrays under other names. The
tree and the state share their buffers.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.errors import DFlashError
from dflash_jax.nn.params import PerLayer, is_per_layer, stack_layers, unstack_layers


RESERVED = ("names", "cfg")  # attributes of the modules themselves: the parameter list, a static config


class Weights(nnx.Module):
    """Named weights: each entry an ``nnx.Param`` (an array or a quantized weight), a nested
    :class:`Weights`, or an ``nnx.List`` of :class:`Layer`.

    Args:
      tree: a parameter tree (a dict; values arrays, :class:`~dflash_jax.nn.quant.QuantizedWeight`,
        dicts or :class:`~dflash_jax.nn.params.PerLayer`); its buffers are shared, not copied.
      axes: the logical axes tree of ``tree`` (``param_axes`` of its model), or ``None`` where
        the model declares none; a param's axes are its ``out_sharding`` metadata.
    Raises:
      DFlashError: a name that is not an identifier or that a method of the module uses.
    """

    def __init__(self, tree: Mapping[str, Any], axes: Mapping[str, Any] | None = None):
        names = []
        for name, value in tree.items():
            if not isinstance(name, str) or not name.isidentifier() or name in RESERVED or hasattr(type(self), name):
                raise DFlashError(f"params[{name!r}]", "a name an NNX module cannot hold as an attribute",
                                  f"an identifier that no attribute of {type(self).__name__} uses")
            setattr(self, name, _node(name, value, None if axes is None else axes.get(name)))
            names.append(name)
        self.names = tuple(names)

    def tree(self) -> dict:
        """The parameter tree these weights hold (the model functions' ``params``): the same buffers."""
        return tree_of(self)


class Layer(Weights):
    """One decoder layer's weights (per layer), or every layer's stacked on a leading ``L`` axis."""


def _node(name: str, value, axes):
    if isinstance(value, Mapping):
        return (Layer if name == "layers" else Weights)(value, axes)
    if is_per_layer(value):
        per = axes if is_per_layer(axes) and len(axes) == len(value) else [None] * len(value)
        return nnx.List([Layer(lp, la) for lp, la in zip(value, per)])
    meta = {} if axes is None else {"out_sharding": tuple(axes)}
    return nnx.Param(value, eager_sharding=False, **meta)


def tree_of(node):
    """The parameter tree a model's weights stand for.

    Args:
      node: a :class:`Weights` module, its ``nnx.State`` (``nnx.state(model)``: the jitted steps'
        ``params``, read at trace time), an ``nnx.Param`` or ``nnx.List``, or a parameter tree
        whose dicts and per-layer layers may hold any of these (``dict(state, fc=...)``).
    Returns:
      dicts of the params' values (arrays or quantized weights), layers held per layer as a
      :class:`~dflash_jax.nn.params.PerLayer` (an ``nnx.List`` and its state's integer keys).
    """
    if isinstance(node, nnx.Variable):
        return node.get_value()
    if isinstance(node, Weights):
        return {name: tree_of(getattr(node, name)) for name in node.names}
    if isinstance(node, nnx.List):
        return PerLayer(tree_of(x) for x in node)
    if isinstance(node, nnx.State):
        keys = list(node.keys())
        if keys and all(isinstance(k, int) for k in keys):
            return PerLayer(tree_of(node[k]) for k in sorted(keys))
        return {k: tree_of(node[k]) for k in keys}
    if isinstance(node, Mapping):
        return {k: tree_of(v) for k, v in node.items()}
    if is_per_layer(node):
        return PerLayer(tree_of(x) for x in node)
    return node


def axes_of(node):
    """The logical axes tree of a :class:`Weights` module's params (their ``out_sharding``;
    ``None`` for a param that has none), shaped like :func:`tree_of`'s tree."""
    if isinstance(node, nnx.Variable):
        names = node.get_metadata().get("out_sharding")
        return None if names is None else tuple(names)
    if isinstance(node, Weights):
        return {name: axes_of(getattr(node, name)) for name in node.names}
    if isinstance(node, nnx.List):
        return PerLayer(axes_of(x) for x in node)
    raise TypeError(f"axes_of: got {type(node).__name__}, expected an NNX Weights module")


def set_weights(module: Weights, weights) -> None:
    """Sets every param of ``module`` to the same weight of ``weights``, in place.

    Args:
      module: a model's :class:`Weights` module (``drafter.model``, ``target.model``).
      weights: a parameter tree, ``nnx.State`` or module of the same model (e.g. a training
        checkpoint's ``state.params``: float32, layers stacked), in either layer layout: layers
        stacked ``[L, ...]`` are split for a module holding them per layer and the reverse; each
        value is cast to its param's dtype.
    Raises:
      DFlashError: a weight missing from ``weights``, one it has that the module lacks, or
        another shape (names the first such weight).
    """
    have, tree = tree_of(module), tree_of(weights)
    if is_per_layer(have.get("layers")) and not is_per_layer(tree.get("layers")):
        tree = unstack_layers(tree)
    elif not is_per_layer(have.get("layers")) and is_per_layer(tree.get("layers")):
        tree = stack_layers(tree)
    shapes = [{jax.tree_util.keystr(k): tuple(jnp.shape(v)) for k, v in jax.tree_util.tree_leaves_with_path(t)} for t in (have, tree)]
    bad = sorted(k for k in shapes[0].keys() | shapes[1].keys() if shapes[0].get(k) != shapes[1].get(k))
    if bad:
        want, got = (sh.get(bad[0]) for sh in shapes)
        raise DFlashError(f"weights{bad[0]}", "missing" if got is None else f"shape {got}",
                          "no such weight: the module has none" if want is None else f"shape {want}, as the module's param")
    values = jax.tree_util.tree_map(lambda new, old: jnp.asarray(new, old.dtype), tree, have)
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, _pure(values))
    nnx.update(module, state)


def _pure(tree):
    """A parameter tree as the nested dicts of an ``nnx.State``'s values (layers per layer keyed 0, 1, ...)."""
    if is_per_layer(tree):
        return {i: _pure(x) for i, x in enumerate(tree)}
    if isinstance(tree, Mapping):
        return {k: _pure(v) for k, v in tree.items()}
    return tree
