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
more often the draft matches; what is committed never changes. One uniform per token costs a
softmax and a cumulative sum over the vocabulary, about what the argmax costs (a Gumbel-max
draw, ``V`` random numbers per token, cost several times more on XLA:CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import DFlashError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings. ``temperature == 0`` means greedy (argmax).

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
                raise DFlashError("--" + name.replace("_", "-"), f"got {v!r}", "a finite number")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise DFlashError("--top-k", f"got {self.top_k!r}", "an integer >= 0")
        if self.temperature < 0:
            raise DFlashError("--temperature", f"got {self.temperature}", "a value >= 0")
        if self.top_k < 0:
            raise DFlashError("--top-k", f"got {self.top_k}", "an integer >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise DFlashError("--top-p", f"got {self.top_p}", "a value in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: jnp.ndarray, cfg: SamplingConfig) -> jnp.ndarray:
    """Temperature, then top-k, then top-p filtering (HF ``generate`` order).

    Args:
      logits: ``[..., V]`` float.
    Returns:
      ``[..., V]`` float32 logits with filtered-out tokens at ``-inf``. Greedy configs return the
      logits unchanged (as float32).
    """
    x = logits.astype(jnp.float32)
    if cfg.greedy:
        return x
    x = x / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        p = jax.nn.softmax(sorted_x, axis=-1)
        keep = (jnp.cumsum(p, axis=-1) - p) < cfg.top_p  # always keeps the best token
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def probabilities(logits: jnp.ndarray, cfg: SamplingConfig) -> jnp.ndarray:
    """The sampling distribution ``[..., V]`` float32 (one-hot argmax when greedy)."""
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(warp_logits(logits, cfg), axis=-1)


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


def uniform_at(rng: jax.Array, index: jnp.ndarray) -> jnp.ndarray:
    """The uniforms of the tokens at ``index`` (module docstring).

    Args:
      rng: ``[B]`` PRNG keys, one per row.
      index: ``[B, T]`` int32 token indices (positions in the row's tokens).
    Returns:
      ``[B, T]`` float32 in ``[0, 1)``, a function of ``(rng[b], index[b, t])`` only.
    """
    def one(key, t):
        return jax.random.uniform(jax.random.fold_in(key, t), (), jnp.float32)

    return jax.vmap(jax.vmap(one, (None, 0)), (0, 0))(rng, index.astype(jnp.uint32))


def sample_at(rng: jax.Array, index: jnp.ndarray, logits: jnp.ndarray, cfg: SamplingConfig, vocab: int | None = None,
              ids: jnp.ndarray | None = None) -> jnp.ndarray:
    """The tokens at ``index`` drawn from ``softmax(warp_logits(logits))`` with their positions'
    uniforms, by inverse transform (exact: token ``i`` is drawn with its probability).

    Args:
      rng: ``[B]`` PRNG keys; index: ``[B, T]`` int32 token indices.
      logits: ``[B, T, V']`` float: the target's (``V' = V``) or a drafter's over the target ids
        ``ids [V']`` (a draft vocabulary), whose probabilities are then laid out over the target's
        vocabulary ``vocab`` before the draw.
      cfg: the sampling settings; greedy returns the argmax and reads no uniform.
      vocab: the target's vocabulary ``V`` when ``ids`` is given.
    Returns:
      ``[B, T]`` int32: column indices of ``logits`` when greedy, else target ids (the same
      thing without ``ids``).
    """
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    p = jax.nn.softmax(warp_logits(logits, cfg).astype(jnp.float32), axis=-1)
    if ids is not None:
        p = jnp.zeros(p.shape[:-1] + (vocab,), p.dtype).at[..., ids].set(p)
    c = jnp.cumsum(p, axis=-1)
    total = c[..., -1:]
    # below the total by at least one ulp: the token drawn has probability > 0 whatever the rounding
    u = jnp.minimum(uniform_at(rng, index)[..., None] * total, jnp.nextafter(total, 0.0))
    return jnp.sum(c <= u, axis=-1).astype(jnp.int32)


def top2_gap(logits: jnp.ndarray) -> jnp.ndarray:
    """Gap between the two largest raw logits, ``[..., V]`` -> ``[...]`` float32."""
    x = logits.astype(jnp.float32)
    best = jnp.argmax(x, axis=-1)
    first = jnp.take_along_axis(x, best[..., None], axis=-1)[..., 0]
    # two reductions instead of lax.top_k, which XLA:CPU lowers to a sort of the vocabulary
    second = jnp.max(jnp.where(jnp.arange(x.shape[-1]) == best[..., None], -jnp.inf, x), axis=-1)
    return first - second
