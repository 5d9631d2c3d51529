"""One declaration per parameter leaf: its shape, logical axes and initialiser.

Each model module builds a tree of :class:`ParamSpec` (``param_specs(cfg)``) shaped like its
parameter pytree; its ``param_shapes``, ``param_axes`` and ``init_params`` are read off that one
tree with :func:`shapes`, :func:`axes` and :func:`init`. :func:`decoder_layer` declares the leaves
shared by every decoder layer (attention, optional gate, SwiGLU MLP) under the same names and
logical axes for the dense targets, Laguna and both drafters.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.errors import DFlashError


class ParamSpec(NamedTuple):
    """One parameter leaf.

    Attributes:
      shape: the array shape.
      axes: one logical axis name (``dflash_jax.sharding``) per dimension.
      init: ``"normal"`` (``scale * N(0, 1)`` in the model dtype), ``"norm"`` (``1 + 0.1 N(0, 1)``,
        model dtype), ``"bias32"`` (``0.1 N(0, 1)`` kept float32) or ``"arange"`` (int32
        ``0..shape[0]-1``).
    """

    shape: tuple
    axes: tuple
    init: str = "normal"


class PerLayer:
    """Decoder layers held per layer: ``L`` dicts of leaves without the layer axis (made by
    :func:`dflash_jax.models.dense.unstack_layers`, run as a Python loop on XLA:CPU), the other
    layout of a params tree's ``"layers"`` beside the stacked dict of ``[L, ...]`` leaves.

    A frozen sequence (``len``, iteration, ``[i]``; a slice gives a :class:`PerLayer`) registered
    as a JAX pytree node whose children are the ``L`` dicts (key paths ``[i]``, as a tuple's), so
    ``jit``, ``tree_map`` and ``tree_unflatten`` give it back as itself; code that builds the
    layers from a comprehension wraps it: ``PerLayer(f(lp) for lp in layers)``. Not a ``tuple``,
    so a tuple of axis names is never mistaken for it nor it for one. Pickles by value.
    """

    __slots__ = ("_layers",)

    def __init__(self, layers=()):
        object.__setattr__(self, "_layers", tuple(layers))

    def __setattr__(self, name, value):
        raise AttributeError("PerLayer is immutable")

    def __len__(self) -> int:
        return len(self._layers)

    def __iter__(self):
        return iter(self._layers)

    def __getitem__(self, i):
        return PerLayer(self._layers[i]) if isinstance(i, slice) else self._layers[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, PerLayer) and self._layers == other._layers

    __hash__ = None  # holds dicts

    def __repr__(self) -> str:
        return f"PerLayer({list(self._layers)!r})"

    def __reduce__(self):
        return PerLayer, (self._layers,)


jax.tree_util.register_pytree_with_keys(
    PerLayer, lambda p: (tuple((jax.tree_util.SequenceKey(i), lp) for i, lp in enumerate(p._layers)), None),
    lambda _, children: PerLayer(children), lambda p: (p._layers, None))


def is_per_layer(layers) -> bool:
    """Whether a params (or logical axes) tree's decoder ``layers`` are held per layer (a
    :class:`PerLayer`) rather than stacked (one dict of ``[L, ...]`` leaves) or absent (a
    segmented family's ``None``). The one test of the two layouts every module uses.

    Raises:
      DFlashError: ``layers`` a plain tuple or list (the untyped per-layer form of before
        :class:`PerLayer`): wrap it, ``PerLayer(layers)``, rather than have it read as stacked.
    """
    if isinstance(layers, (tuple, list)):
        raise DFlashError("params[\"layers\"]", f"a plain {type(layers).__name__} of {len(layers)} layers",
                          "a dict of stacked [L, ...] leaves or dflash_jax.models.params.PerLayer(layers) for per-layer ones")
    return isinstance(layers, PerLayer)


def repeat_segments(sig: list, max_period: int = 8) -> tuple[tuple[int, int, int], ...]:
    """Splits layers of signatures ``sig`` (layers with equal signatures have parameters of equal
    shapes) into ``(first layer, period p, reps)`` runs of a repeated pattern, each run one
    ``lax.scan`` over its repetitions with the pattern unrolled in the body.

    Greedy from the first layer: the pattern length ``p <= max_period`` (repeated at least twice
    when ``p > 1``) covering the most layers wins, shorter patterns on ties.
    """
    n, i, out = len(sig), 0, []
    while i < n:
        r = 1
        while i + r < n and sig[i + r] == sig[i]:
            r += 1
        best = (1, r)
        for p in range(2, max_period + 1):
            reps = 0
            while i + (reps + 1) * p <= n and sig[i + reps * p : i + (reps + 1) * p] == sig[i : i + p]:
                reps += 1
            if reps >= 2 and p * reps > best[0] * best[1]:
                best = (p, reps)
        out.append((i, best[0], best[1]))
        i += best[0] * best[1]
    return tuple(out)


def segmented_specs(cfg, segments, layer_specs) -> dict:
    """The :class:`ParamSpec` tree of a target whose layers are stacked by :func:`repeat_segments`
    runs: ``embed [V, H]``, ``norm [H]``, ``lm_head [H, V]`` unless ``cfg.tie_word_embeddings``,
    and ``"seg{j}_{k}"``: the specs ``layer_specs(layer)`` of pattern slot ``k`` of run ``j``
    stacked over the run's repetitions (:func:`stacked`)."""
    H = cfg.hidden_size
    specs: dict = {"embed": ParamSpec((cfg.vocab_size, H), ("vocab", "embed")), "norm": ParamSpec((H,), ("embed",), "norm")}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((H, cfg.vocab_size), ("embed", "vocab"))
    for j, (start, p, reps) in enumerate(segments):
        for k in range(p):
            specs[f"seg{j}_{k}"] = stacked(reps, layer_specs(start + k))
    return specs


def segment_slot(segments, layer: int) -> tuple[str, int]:
    """``(params key "seg{j}_{k}", repetition index)`` holding decoder layer ``layer`` of the
    :func:`repeat_segments` runs ``segments``. Raises IndexError for a layer outside them."""
    for j, (start, p, reps) in enumerate(segments):
        if start <= layer < start + p * reps:
            r, k = divmod(layer - start, p)
            return f"seg{j}_{k}", r
    raise IndexError(layer)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def stacked(n: int, layer: dict) -> dict:
    """``layer``'s specs with a leading ``n``-sized ``"layers"`` axis (layers run by one scan)."""
    return {k: ParamSpec((n,) + s.shape, ("layers",) + s.axes, s.init) for k, s in layer.items()}


def shapes(specs) -> dict:
    """The tree of shapes (tuples) of a spec tree."""
    return jax.tree_util.tree_map(lambda s: tuple(s.shape), specs, is_leaf=_is_spec)


def axes(specs, per_layer: bool = False) -> dict:
    """The tree of logical axis names (tuples) of a spec tree. With ``per_layer``, its stacked
    ``"layers"`` dict becomes the :class:`PerLayer` of :func:`dflash_jax.models.dense.unstack_layers`: one
    dict per layer of the axes without their leading ``"layers"`` name."""
    out = jax.tree_util.tree_map(lambda s: tuple(s.axes), specs, is_leaf=_is_spec)
    if per_layer:
        layers = specs["layers"]
        n = next(iter(layers.values())).shape[0]
        out["layers"] = PerLayer({k: tuple(s.axes[1:]) for k, s in layers.items()} for _ in range(n))
    return out


def init(specs, key: jax.Array, scale: float, dtype) -> dict:
    """Random parameters of a spec tree: one subkey per leaf in flattening order, each leaf drawn
    as its :attr:`ParamSpec.init` says (``"arange"`` leaves use no randomness but take a key)."""
    flat, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(flat))
    out = []
    for s, k in zip(flat, keys):
        if s.init == "arange":
            out.append(jnp.arange(s.shape[0], dtype=jnp.int32))
            continue
        x = jax.random.normal(k, s.shape, jnp.float32)
        if s.init == "bias32":
            out.append(0.1 * x)
            continue
        x = 1.0 + 0.1 * x if s.init == "norm" else scale * x
        out.append(x.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def decoder_layer(hidden: int, q_heads: int, kv_heads: int, head_dim: int, mlp: int = 0, *, qkv_bias: bool = False,
                  o_bias: bool = False, mlp_bias: bool = False, qk_norm: bool = False, gate: int = 0) -> dict:
    """Specs of one decoder layer's leaves (no layer axis): ``attn_norm``, ``wq``/``wk``/``wv``/``wo``,
    ``mlp_norm``; ``bq``/``bk``/``bv`` with ``qkv_bias``, ``bo`` with ``o_bias``, ``q_norm``/``k_norm``
    with ``qk_norm``, ``wg [H, gate]`` when ``gate`` > 0, and the SwiGLU MLP ``w_gate``/``w_up``/``w_down``
    (plus ``b_*`` with ``mlp_bias``) when ``mlp`` > 0."""
    H, qd, kd, D, I = hidden, q_heads * head_dim, kv_heads * head_dim, head_dim, mlp
    s = {
        "attn_norm": ParamSpec((H,), ("embed",), "norm"), "mlp_norm": ParamSpec((H,), ("embed",), "norm"),
        "wq": ParamSpec((H, qd), ("embed", "q_heads")), "wk": ParamSpec((H, kd), ("embed", "kv_heads")),
        "wv": ParamSpec((H, kd), ("embed", "kv_heads")), "wo": ParamSpec((qd, H), ("q_heads", "embed")),
    }
    if qkv_bias:
        s.update(bq=ParamSpec((qd,), ("q_heads",)), bk=ParamSpec((kd,), ("kv_heads",)), bv=ParamSpec((kd,), ("kv_heads",)))
    if o_bias:
        s.update(bo=ParamSpec((H,), ("embed",)))
    if qk_norm:
        s.update(q_norm=ParamSpec((D,), ("head_dim",), "norm"), k_norm=ParamSpec((D,), ("head_dim",), "norm"))
    if gate:
        s.update(wg=ParamSpec((H, gate), ("embed", "gate")))
    if mlp:
        s.update(w_gate=ParamSpec((H, I), ("embed", "mlp")), w_up=ParamSpec((H, I), ("embed", "mlp")),
                 w_down=ParamSpec((I, H), ("mlp", "embed")))
    if mlp and mlp_bias:
        s.update(b_gate=ParamSpec((I,), ("mlp",)), b_up=ParamSpec((I,), ("mlp",)), b_down=ParamSpec((H,), ("embed",)))
    return s
