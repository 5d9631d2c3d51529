"""Token selection as pure functions of logits and keys: greedy, temperature, top-k, top-p.

The same warp is applied everywhere a distribution over the target's vocabulary is needed (plain
decoding, verification, sampled drafts), so all paths sample one distribution.

Sampling is indexed by position: each row of a decode state carries its own PRNG key, and the
token at index ``t`` of row ``b`` (its place in ``DecodeState.tokens``) is drawn by inverse
transform with the uniform ``u`` of ``fold_in(rng[b], t)``: the first token, in vocabulary order,
whose cumulative probability under ``softmax(warp(logits))`` exceeds ``u`` (:func:`sample_at`).
Plain decoding draws each token this way; a speculative verify draws the target's token at every
slot of the block with the same uniforms and accepts a draft while it equals that token ("sample
and match", docs/specs/dflash.md 2.2), the first differing target token being the bonus. Every
committed token is then the target's own sample, so a row's sampled text is a function of its
key, its prompt and the target only: the same with or without a drafter, at any verify width,
alone or in any batch. A sampled draft uses the same uniform over the drafter's distribution (in
the target's vocabulary order), which couples the two distributions: the closer they are, the
more often the draft matches; what is committed never changes. (A draft drawn from the drafter's
distribution ``q`` is accepted more often by the standard rejection rule, ``Decoding(draft_mode=
"reject")``, at the price of this promise; an argmax draft, the default's, is accepted by both
rules with the same probability ``p(draft)``: docs/performance.md, "Sampled requests".) The
promise holds up to float rounding: a verify pass of several tokens and a one-token plain pass
compute a position's logits with different rounding, and a uniform within that distance of a
boundary of the cumulative distribution draws the neighbouring token. One uniform per token costs a
softmax and a cumulative sum over the vocabulary, about what the argmax costs (a Gumbel-max
draw, ``V`` random numbers per token, cost several times more on XLA:CPU).

The settings are each row's own (:class:`RowSampling`, in the decode state, traced): greedy and
sampled rows share one compiled step, a greedy row's token is the argmax whatever its neighbours
do, and the draw and the sort of the top-k/top-p filters run under conditionals that skip them
when no row needs them (an all-greedy batch costs what it cost when sampling was static).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import jax
import jax.numpy as jnp
import numpy as np
from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import axes_field
from dflash_jax.errors import DFlashError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """One row's sampling settings (a request's, or every row's of a ``generate`` call), laid
    out in the decode state by :meth:`RowSampling.of`. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0`` and ``top_p == 1.0`` disable those filters. Raises DFlashError on values out
    of range (negative temperature or top_k, top_p outside (0, 1]), non-finite values (nan, inf)
    and values of the wrong type.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise DFlashError(f"{name} (--{name.replace('_', '-')})", f"got {v!r}", "a finite number")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise DFlashError("top_k (--top-k)", f"got {self.top_k!r}", "an integer >= 0")
        if self.temperature < 0:
            raise DFlashError("temperature (--temperature)", f"got {self.temperature}", "a value >= 0")
        if not 0 <= self.top_k < 2**31:
            raise DFlashError("top_k (--top-k)", f"got {self.top_k}", "an integer in [0, 2**31) (0: off)")
        if not 0.0 < self.top_p <= 1.0:
            raise DFlashError("top_p (--top-p)", f"got {self.top_p}", "a value in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@pytree.dataclass
class RowSampling:
    """Each row's sampling settings, carried in the decode state (traced: one compiled step serves
    any mix of greedy and sampled rows, and a row keeps its settings wherever it runs).

    Attributes:
      temperature: ``[B]`` float32, ``0`` greedy (the argmax).
      top_k: ``[B]`` int32, ``0`` (or the vocabulary size or more) off.
      top_p: ``[B]`` float32 in ``(0, 1]``, ``1`` off.
    """

    temperature: jnp.ndarray = axes_field("batch")
    top_k: jnp.ndarray = axes_field("batch")
    top_p: jnp.ndarray = axes_field("batch")

    @classmethod
    def of(cls, sampling, rows: int) -> "RowSampling":
        """The settings of ``rows`` rows from one :class:`SamplingConfig` for all of them or a list
        of one per row.

        Raises:
          DFlashError: anything else, or a list of another length (names ``sampling``).
        """
        cfgs = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * rows
        if len(cfgs) != rows or not all(isinstance(c, SamplingConfig) for c in cfgs):
            got = f"{len(cfgs)} settings for {rows} rows" if len(cfgs) != rows else f"got {sampling!r}"
            raise DFlashError("sampling", got, "a SamplingConfig for every row, or a list of one per row")
        return cls(temperature=jnp.asarray(np.array([c.temperature for c in cfgs], np.float32)),
                   top_k=jnp.asarray(np.array([c.top_k for c in cfgs], np.int32)),
                   top_p=jnp.asarray(np.array([c.top_p for c in cfgs], np.float32)))


def _settings(sampling, x: jnp.ndarray):
    """``(temperature, top_k, top_p)`` of a :class:`SamplingConfig` (scalars: the conditionals
    below fold away) or a :class:`RowSampling` (``[B, 1, ...]``), broadcasting against ``x [B, ..., V]``."""
    if isinstance(sampling, SamplingConfig):
        return jnp.float32(sampling.temperature), jnp.int32(sampling.top_k), jnp.float32(sampling.top_p)
    shape = (-1,) + (1,) * (x.ndim - 1)
    return tuple(a.reshape(shape) for a in (sampling.temperature, sampling.top_k, sampling.top_p))


def warp_logits(logits: jnp.ndarray, sampling) -> jnp.ndarray:
    """Temperature, then top-k, then top-p filtering (HF ``generate`` order).

    Args:
      logits: ``[..., V]`` float (``[B, ..., V]`` with a :class:`RowSampling`).
      sampling: a :class:`SamplingConfig` for every row, or a :class:`RowSampling`.
    Returns:
      ``[..., V]`` float32 logits with filtered-out tokens at ``-inf``; a greedy row's (temperature
      0) are the logits unchanged. The filters sort the vocabulary, under a conditional that
      skips them when no row filters.
    """
    x = logits.astype(jnp.float32)
    t, k, p = _settings(sampling, x)
    x = x / jnp.where(t > 0, t, 1.0)
    on = ((k > 0) & (k < x.shape[-1])) | (p < 1.0)
    return jax.lax.cond(jnp.any(on), _filter, lambda x, k, p: x, x, k, p)


def _filter(x: jnp.ndarray, k: jnp.ndarray, p: jnp.ndarray) -> jnp.ndarray:
    """Top-k then top-p of ``x [..., V]``; each filter is the identity where it is off.

    Top-k keeps the tokens at or above the ``k``-th largest value; top-p then keeps the tokens at
    or above the largest value ``c`` whose tokens ``x >= c`` hold at least ``p`` of the
    renormalized mass (the tokens of a sorted cumulative sum up to ``p``, ties kept). Both
    thresholds are found by bisection over the order-preserving bit patterns of the values (32
    steps of a count or a sum over the vocabulary, exact): a sort of the vocabulary per token
    costs 20-40 times more on XLA:CPU (620 ms for 32 rows of 49152)."""
    v = x.shape[-1]
    order = _ordered_bits(x)
    k_on = (k > 0) & (k < v)
    kth = jax.lax.cond(jnp.any(k_on), lambda: _largest(order, lambda m: jnp.sum(order >= m, axis=-1, keepdims=True) >= k),
                       lambda: jnp.zeros(order.shape[:-1] + (1,), jnp.uint32))
    x = jnp.where(k_on & (order < kth), -jnp.inf, x)
    prob = jax.nn.softmax(x, axis=-1)
    p_on = p < 1.0

    def nucleus():
        return _largest(order, lambda m: jnp.sum(jnp.where(order >= m, prob, 0.0), axis=-1, keepdims=True) >= p)

    cut = jax.lax.cond(jnp.any(p_on), nucleus, lambda: jnp.zeros(order.shape[:-1] + (1,), jnp.uint32))
    return jnp.where(p_on & (order < cut), -jnp.inf, x)


def _ordered_bits(x: jnp.ndarray) -> jnp.ndarray:
    """``x`` float32 as uint32 in the same order (negative values' bits flipped, positive values'
    sign bit set)."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(1 << 31))


def _largest(order: jnp.ndarray, holds) -> jnp.ndarray:
    """The largest ``m`` among ``order [..., V]``'s range with ``holds(m)`` true (``[..., 1]``
    uint32; ``holds`` must be true at the smallest value and monotone), by bisection."""
    lo = jnp.min(order, axis=-1, keepdims=True)
    hi = jnp.max(order, axis=-1, keepdims=True)

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + ((hi - lo) & 1)  # the upper middle, without overflow
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]


def probabilities(logits: jnp.ndarray, sampling) -> jnp.ndarray:
    """The sampling distribution ``[..., V]`` float32 (one-hot argmax for a greedy row)."""
    t = _settings(sampling, logits)[0]
    hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(t > 0, jax.nn.softmax(warp_logits(logits, sampling), axis=-1), hot)


def row_keys(seed, rows: int) -> jax.Array:
    """The ``[rows]`` PRNG keys of a decode state's rows.

    Args:
      seed: an integer in ``[0, 2**63)`` or a PRNG key: row ``b`` gets ``fold_in(key, b)``; or a
        list of ``rows`` such integers: row ``b`` gets row 0's key of its own seed (a server
        request keeps the key of its seed in whatever row it lands).
      rows: the batch size ``B``.
    Raises:
      DFlashError: a seed that is none of these (names ``--seed``).
    """
    if isinstance(seed, (list, tuple)):
        if len(seed) != rows:
            raise DFlashError("seed (--seed)", f"got {len(seed)} seeds for {rows} rows", "one seed per prompt")
        return _first_rows(jnp.stack([_key(s) for s in seed]))
    return _rows_of(_key(seed), rows)


def _key(seed) -> jax.Array:
    """A PRNG key from an integer seed in ``[0, 2**63)`` or a key (DFlashError naming ``--seed`` otherwise)."""
    if isinstance(seed, numbers.Integral) and not isinstance(seed, (bool, np.bool_)):
        if not 0 <= seed < 2**63:
            raise DFlashError("seed (--seed)", f"got {seed}", "an integer in [0, 2**63)")
        return jax.random.key(int(seed))
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) and seed.shape == ():
        return seed
    raise DFlashError("seed (--seed)", f"got {seed!r}", "an integer in [0, 2**63), a PRNG key or one integer per prompt")


@functools.partial(jax.jit, static_argnums=(1,))
def _rows_of(key: jax.Array, rows: int) -> jax.Array:
    return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(rows, dtype=jnp.uint32))


@jax.jit
def _first_rows(keys: jax.Array) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)


def uniform_at(rng: jax.Array, index: jnp.ndarray, stream: int = 0) -> jnp.ndarray:
    """The uniforms of the tokens at ``index`` (module docstring).

    Args:
      rng: ``[B]`` PRNG keys, one per row.
      index: ``[B, T]`` int32 token indices (positions in the row's tokens).
      stream: ``0`` the draw of the token itself; another (static) integer a further uniform of
        that position, independent of it (``fold_in(fold_in(rng[b], t), stream)``: the rejection
        rule's accept test and residual draw, :func:`dflash_jax.decode.step.reject_rule`).
    Returns:
      ``[B, T]`` float32 in ``[0, 1)``, a function of ``(rng[b], index[b, t], stream)`` only.
    """
    def one(key, t):
        key = jax.random.fold_in(key, t)
        return jax.random.uniform(jax.random.fold_in(key, stream) if stream else key, (), jnp.float32)

    return jax.vmap(jax.vmap(one, (None, 0)), (0, 0))(rng, index.astype(jnp.uint32))


def sample_at(rng: jax.Array, index: jnp.ndarray, logits: jnp.ndarray, sampling, vocab: int | None = None,
              ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """The tokens at ``index`` drawn from ``softmax(warp_logits(logits))`` with their positions'
    uniforms, by inverse transform (exact: token ``i`` is drawn with its probability); the argmax
    for a greedy row.

    Args:
      rng: ``[B]`` PRNG keys; index: ``[B, T]`` int32 token indices.
      logits: ``[B, T, V']`` float: the target's (``V' = V``) or a drafter's over the target ids
        ``ids [V']`` (a draft vocabulary), whose probabilities are then laid out over the target's
        vocabulary ``vocab`` before the draw.
      sampling: a :class:`RowSampling` (each row its own settings; the draw runs under a
        conditional that skips it when every row is greedy) or one :class:`SamplingConfig` for
        every row (a greedy one reads no uniform).
      vocab: the target's vocabulary ``V`` when ``ids`` is given.
    Returns:
      ``[B, T]`` int32 target ids (column indices of ``logits`` without ``ids``).
    """
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if ids is not None:
        best = jnp.take(ids, best).astype(jnp.int32)
    if isinstance(sampling, SamplingConfig) and sampling.greedy:
        return best
    t = _settings(sampling, best)[0]

    def draw(_):
        p = jax.nn.softmax(warp_logits(logits, sampling), axis=-1)
        if ids is not None:
            p = jnp.zeros(p.shape[:-1] + (vocab,), p.dtype).at[..., ids].set(p)
        return jnp.where(t > 0, inverse_cdf(p, uniform_at(rng, index)), best)

    return jax.lax.cond(jnp.any(t > 0), draw, lambda _: best, None)


def inverse_cdf(p: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
    """The token ``[...]`` int32 drawn from the weights ``p [..., V]`` (not necessarily normalized,
    a positive sum) with the uniforms ``u [...]`` in ``[0, 1)``: the first token whose cumulative
    weight exceeds ``u`` times the total (a token of weight 0 is never drawn)."""
    c = jnp.cumsum(p, axis=-1)
    total = c[..., -1:]
    # below the total by at least one ulp: the token drawn has probability > 0 whatever the rounding
    v = jnp.minimum(u[..., None] * total, jnp.nextafter(total, 0.0))
    return jnp.sum(c <= v, axis=-1).astype(jnp.int32)


def top2_gap(logits: jnp.ndarray) -> jnp.ndarray:
    """Gap between the two largest raw logits, ``[..., V]`` -> ``[...]`` float32."""
    x = logits.astype(jnp.float32)
    best = jnp.argmax(x, axis=-1)
    first = jnp.take_along_axis(x, best[..., None], axis=-1)[..., 0]
    # two reductions instead of lax.top_k, which XLA:CPU lowers to a sort of the vocabulary
    second = jnp.max(jnp.where(jnp.arange(x.shape[-1]) == best[..., None], -jnp.inf, x), axis=-1)
    return first - second
