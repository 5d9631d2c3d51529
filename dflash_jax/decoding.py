"""The static part of a decode step, in one frozen object, and the parameters in one pytree.

Every step has the same signature, ``f(params, state, static, ...)``: ``params`` is a
:class:`Params` pytree (target and drafter weights), ``state`` the
:class:`~dflash_jax.state.DecodeState` carry and ``static`` a :class:`Decoding`, hashable, so that
it is a static argument of every jitted step (one compile per decoding set-up).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

from dflash_jax.config import check_drafter_fits
from dflash_jax.errors import DFlashError
from dflash_jax.sampling import SamplingConfig

DRAFT_MODES = ("argmax", "sample")


class Params(NamedTuple):
    """The weights a step reads: the target's parameter pytree and the drafter's (``None`` for
    plain decoding). A pytree, so it is one argument of every jitted step."""

    target: Any
    drafter: Any = None


@dataclasses.dataclass(frozen=True)
class Decoding:
    """What a decode step does, fixed for a whole generation (hashable: a static jit argument).

    Attributes:
      target: the target config (``TargetConfig`` or ``LagunaConfig``).
      drafter: a :class:`~dflash_jax.config.DrafterConfig` for DFlash speculative decoding, or
        ``None`` for plain decoding.
      sampling: :class:`~dflash_jax.sampling.SamplingConfig` (default greedy).
      draft_mode: ``"argmax"`` (propose the drafter's argmax; default, docs/specs/dflash.md 2.2)
        or ``"sample"`` (draw each draft from the warped drafter distribution).
      n_max: drafted tokens per block, in ``[1, block_size - 1]``; ``None`` resolves to
        ``block_size - 1`` with a drafter (and must stay ``None`` without one).
    Raises:
      DFlashError: a drafter that does not fit the target, a bad ``n_max`` or ``draft_mode``,
        a ``sampling`` that is not a :class:`SamplingConfig`, or ``n_max`` without a drafter.
    """

    target: Any
    drafter: Any = None
    sampling: SamplingConfig = SamplingConfig()
    draft_mode: str = "argmax"
    n_max: int | None = None

    def __post_init__(self):
        if not isinstance(self.sampling, SamplingConfig):
            raise DFlashError("sampling", f"got {type(self.sampling).__name__}", "a SamplingConfig, e.g. SamplingConfig(temperature=0.7)")
        if self.draft_mode not in DRAFT_MODES:
            raise DFlashError("draft_mode", f"got {self.draft_mode!r}", f"one of {', '.join(DRAFT_MODES)}")
        if self.drafter is None:
            if self.n_max is not None:
                raise DFlashError("n_max (--n-max)", f"got {self.n_max} without a drafter (plain decoding drafts nothing)", "a drafter, or n_max=None")
            return
        check_drafter_fits(self.drafter, self.target)
        object.__setattr__(self, "n_max", check_n_max(self.drafter, self.n_max))

    @property
    def speculative(self) -> bool:
        """Whether a drafter proposes blocks (DFlash) rather than one token per step (plain)."""
        return self.drafter is not None

    @property
    def width(self) -> int:
        """Tokens one target pass reads per row: ``n_max + 1`` (anchor and drafts), or 1 (plain)."""
        return 1 if self.drafter is None else self.n_max + 1


def check_n_max(cfg_d, n_max: int | None) -> int:
    """Resolves the proposal depth: ``None`` means ``block_size - 1``.

    Raises:
      DFlashError: ``n_max`` outside ``[1, block_size - 1]`` (names ``--n-max``).
    """
    top = cfg_d.block_size - 1
    if n_max is None:
        return top
    if isinstance(n_max, bool) or not isinstance(n_max, numbers.Integral) or not 1 <= n_max <= top:
        raise DFlashError("n_max (--n-max)", f"got {n_max!r}", f"an integer in [1, {top}] (block_size - 1)")
    return int(n_max)
