"""Parameter trees: one declaration per leaf (shape, logical axes, initialiser), layers stacked or
per layer, and ``[out, in]`` weight copies for wide passes.

**Declarations.** Each model module builds a tree of :class:`ParamSpec` (``param_specs(cfg)``) shaped like its
parameter pytree; its ``param_shapes``, ``param_axes`` and ``init_params`` are read off that one
tree with :func:`shapes`, :func:`axes` and :func:`init`. :func:`decoder_layer` declares the leaves
shared by every decoder layer (attention, optional gate, SwiGLU MLP) under the same names and
logical axes for the dense targets, Laguna and both drafters.

**Layouts.** ``[out, in]`` copies of weights that XLA:CPU multiplies faster that way in wide
passes. The models hold their weights ``[in, out]`` and multiply ``x @ W``. Timed alone
(``tools/bench_layout.py`` at commit 9868b87, BENCHMARKS.md "Weight layout against pass width"), XLA:CPU multiplies
the MLP's gate and up projections about 1.26x faster from 2 rows (``B * T``) on, and the LM head
about 1.22x faster from 3 rows on, with the weight held ``[out, in]`` as ``W x^T``; one row, and
q, k, v, o and down at every width, prefer ``[in, out]``.

So a dense target can hold both: its weights, and ``[out, in]`` copies
(:func:`with_wide_layouts`); each matmul picks by its static row count (:func:`project`), with
the same values (float32 sums in another order). Whether a whole pass gets faster,
``tools/bench_layout.py --passes`` (at commit 9868b87) times the real forward with and without the copies
(BENCHMARKS.md, "Weight layout in a whole target pass"): on XLA:CPU the gate/up copies make it
slower and only the LM head's pays (about 4 % from 3 rows on). So on the CPU backend
:func:`dflash_jax.loading.load_target` adds :data:`CPU_KINDS` (for the tied default target the
copy is the embedding itself: no memory); fingerprints hash :func:`canonical` trees and
:func:`dflash_jax.runtime.sharding.param_shardings` places the copies by :func:`with_wide_axes`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.nn import quant


class ParamSpec(NamedTuple):
    """One parameter leaf.

    Attributes:
      shape: the array shape.
      axes: one logical axis name (``dflash_jax.runtime.sharding``) per dimension.
      init: ``"normal"`` (``scale * N(0, 1)`` in the model dtype), ``"norm"`` (``1 + 0.1 N(0, 1)``,
        model dtype), ``"bias32"`` (``0.1 N(0, 1)`` kept float32) or ``"arange"`` (int32
        ``0..shape[0]-1``).
    """

    shape: tuple
    axes: tuple
    init: str = "normal"


class PerLayer:
    """Decoder layers held per layer: ``L`` dicts of leaves without the layer axis (made by
    :func:`unstack_layers`, run as a Python loop on XLA:CPU), the other
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
                          "a dict of stacked [L, ...] leaves or dflash_jax.nn.params.PerLayer(layers) for per-layer ones")
    return isinstance(layers, PerLayer)


def unstack_layers(params: dict) -> dict:
    """``params`` with ``"layers"`` as a :class:`PerLayer` of ``L`` dicts: each stacked leaf
    ``[L, ...]`` becomes ``L`` leaves ``[...]`` of the same dtype (one buffer per layer and
    weight; a no-op when already unstacked). The arrays are copies: the stacked ones can be freed.
    Source: the per-step weight copies of ``lax.scan`` on XLA:CPU (BENCHMARKS.md, plain-decoding
    notes)."""
    if is_per_layer(params["layers"]):
        return params
    leaves = jax.tree_util.tree_leaves(params["layers"])
    if all(isinstance(a, jax.Array) for a in leaves):  # one program, not one eager slice per leaf and layer
        return dict(params, layers=_split_layers(params["layers"], leaves[0].shape[0]))
    return dict(params, layers=_split_layers.__wrapped__(params["layers"], leaves[0].shape[0]))  # numpy: views


@functools.partial(jax.jit, static_argnums=1)
def _split_layers(layers, n: int) -> PerLayer:
    return PerLayer(jax.tree_util.tree_map(lambda a, i=i: a[i], layers) for i in range(n))


def stack_layers(params: dict) -> dict:
    """The inverse of :func:`unstack_layers`: ``L`` per-layer leaves ``[...]`` become one ``[L, ...]``
    leaf each (a no-op on stacked parameters). Raises ``ValueError`` from ``jnp.stack`` when the
    layers' shapes differ."""
    if not is_per_layer(params["layers"]):
        return params
    return dict(params, layers=jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params["layers"]))


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
    ``"layers"`` dict becomes the :class:`PerLayer` of :func:`unstack_layers`: one
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

GATE_UP_MIN_ROWS = 2  # gate/up from this many rows (B * T) on use their [out, in] copies
HEAD_MIN_ROWS = 3  # the LM head from this many rows on uses its [out, in] copy
KINDS = ("gate_up", "lm_head")
# What the loaders add on XLA:CPU: a whole pass measured faster only with the LM head's copy
# (about 1.04x from 3 rows on; the gate/up copies made it 1-15 % slower), BENCHMARKS.md
# "Weight layout in a whole target pass".
CPU_KINDS = ("lm_head",)


def _swap(a):
    """``a`` with its last two axes swapped, in a buffer of its own (numpy or JAX)."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(np.swapaxes(a, -1, -2))
    return jnp.asarray(jnp.swapaxes(a, -1, -2))


def _each_layer(layers, f):
    """``f`` applied to every layer dict: the :class:`PerLayer` ones, or the one stacked dict."""
    return PerLayer(f(lp) for lp in layers) if is_per_layer(layers) else f(layers)


def with_wide_layouts(params: dict, kinds=KINDS, tied: bool = False) -> dict:
    """``params`` of a dense target plus ``[out, in]`` copies for wide passes.

    Args:
      params: a dense target's pytree (:mod:`dflash_jax.families.dense.model`), layers stacked
        (``[L, H, I]`` leaves) or per layer; numpy or JAX leaves.
      kinds: which copies, of :data:`KINDS`: ``"gate_up"`` adds ``w_gate_t`` and ``w_up_t``
        (``[I, H]``, or ``[L, I, H]`` stacked) to every layer, ``"lm_head"`` adds
        ``lm_head_t [V, H]`` (none without ``lm_head``: a tied embedding is ``[V, H]`` already).
      tied: ``lm_head`` is a copy of the embedding (:func:`dflash_jax.loading.with_output_head`):
        ``lm_head_t`` is then the embedding itself, no new buffer.
    Returns:
      the tree with those copies (the models use them from :data:`GATE_UP_MIN_ROWS` and
      :data:`HEAD_MIN_ROWS` rows on). Quantized weights (:class:`~dflash_jax.nn.quant.QuantizedWeight`)
      get none: their fields are held ``[out, in]`` already.
    Raises:
      DFlashError: a kind not in :data:`KINDS`.
    """
    if set(kinds) - set(KINDS):
        raise DFlashError("kinds", f"got {sorted(set(kinds) - set(KINDS))}", f"some of {KINDS}")
    out = dict(params)

    def gate_up(lp):
        if quant.is_quantized(lp["w_gate"]) or quant.is_quantized(lp["w_up"]):
            return lp  # quantized weights are held [out, in] already (their rows); no float copy
        return dict(lp, w_gate_t=_swap(lp["w_gate"]), w_up_t=_swap(lp["w_up"]))

    if "gate_up" in kinds:
        out["layers"] = _each_layer(params["layers"], gate_up)
    if "lm_head" in kinds and "lm_head" in params and not quant.is_quantized(params["lm_head"]):
        # without lm_head the tied embedding [V, H] is the head already; a quantized head has no copy
        out["lm_head_t"] = params["embed"] if tied else _swap(params["lm_head"])
    return out


def canonical(tree):
    """``tree`` without the copies of :func:`with_wide_layouts` (any other tree as it is): what
    fingerprints hash."""
    if not isinstance(tree, dict) or not (isinstance(tree.get("layers"), dict) or is_per_layer(tree.get("layers"))):
        return tree
    layers = _each_layer(tree["layers"], lambda lp: {k: v for k, v in lp.items() if k not in ("w_gate_t", "w_up_t")})
    return {k: (layers if k == "layers" else v) for k, v in tree.items() if k != "lm_head_t"}


def with_wide_axes(axes: dict, params: dict) -> dict:
    """The logical axes of ``params`` from its model's ``param_axes`` tree ``axes``, adding those of
    the copies ``params`` holds and ``axes`` does not name: these copies, and a tied embedding's
    ``lm_head [H, V]`` (:func:`dflash_jax.loading.with_output_head`); a copy has its weight's axes
    in the other order."""
    if not isinstance(params, dict) or not isinstance(axes, dict) or "layers" not in params:
        return axes
    out = dict(axes)
    if "lm_head" in params and "lm_head" not in out and "embed" in out:
        out["lm_head"] = out["embed"][::-1]
    if "lm_head_t" in params and "lm_head_t" not in out and "lm_head" in out:
        out["lm_head_t"] = out["lm_head"][::-1]

    def add(lp, la):
        return dict(la, **{k: la[k[:-2]][:-2] + la[k[:-2]][:-3:-1] for k in ("w_gate_t", "w_up_t") if k in lp and k not in la})

    layers, la = params["layers"], axes.get("layers")
    if is_per_layer(layers) and is_per_layer(la) and len(la) == len(layers):
        out["layers"] = PerLayer(add(lp, a) for lp, a in zip(layers, la))
    elif isinstance(layers, dict) and isinstance(la, dict):
        out["layers"] = add(layers, la)
    return out


def project(x: jnp.ndarray, w, wt, min_rows: int, preferred_element_type=None) -> jnp.ndarray:
    """``x [..., in] @ w [in, out]`` -> ``[..., out]``, computed as ``wt x^T`` with the copy
    ``wt [out, in]`` instead when there is one (not ``None``) and ``x`` has at least ``min_rows``
    rows (the product of its leading dims, static). The expression is the one
    ``tools/bench_layout.py`` at commit 9868b87 timed; ``preferred_element_type`` as in ``jnp.einsum``.
    A quantized ``w`` goes through :func:`dflash_jax.nn.quant.dot` (``wt`` is then ``None``)."""
    rows = math.prod(x.shape[:-1])
    if quant.is_quantized(w):
        return quant.dot(x, w, preferred_element_type)
    if wt is None or rows < min_rows:
        if preferred_element_type is None:
            return x @ w
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=preferred_element_type)
    y = jnp.einsum("oi,ri->ro", wt, x.reshape(rows, x.shape[-1]), preferred_element_type=preferred_element_type)
    return y.reshape(x.shape[:-1] + (wt.shape[0],))
