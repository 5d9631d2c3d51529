"""Token selection as pure functions of logits and a key: greedy, temperature, top-k, top-p.

The same warp is applied everywhere a distribution over the target's vocabulary is needed (plain
decoding, speculative acceptance, resampling), so all paths sample one distribution.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

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


def sample(key: jax.Array, logits: jnp.ndarray, cfg: SamplingConfig) -> jnp.ndarray:
    """Draws one token per row: ``[..., V]`` logits -> ``[...]`` int32 ids."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp_logits(logits, cfg), axis=-1).astype(jnp.int32)


def top2_gap(logits: jnp.ndarray) -> jnp.ndarray:
    """Gap between the two largest raw logits, ``[..., V]`` -> ``[...]`` float32."""
    x = logits.astype(jnp.float32)
    best = jnp.argmax(x, axis=-1)
    first = jnp.take_along_axis(x, best[..., None], axis=-1)[..., 0]
    # two reductions instead of lax.top_k, which XLA:CPU lowers to a sort of the vocabulary
    second = jnp.max(jnp.where(jnp.arange(x.shape[-1]) == best[..., None], -jnp.inf, x), axis=-1)
    return first - second
