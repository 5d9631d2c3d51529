"""Training settings and the optimizer (``docs/specs/dflash.md`` 3.7): AdamW with linear warmup
then cosine, linear or constant decay, and global-norm gradient clipping.

``optax`` is imported by the functions that build the optimizer, so that the command line's
parser (which reads :data:`DECAYS` and :data:`COMPUTE_DTYPES`) does not import it for
``dflash-jax generate``."""

from __future__ import annotations

import dataclasses
import math

from dflash_jax.errors import DFlashError

DECAYS = ("cosine", "linear", "constant")
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static training settings (hashable: a jit static argument).

    Attributes:
      steps: total optimizer steps (the schedule's length).
      batch_size: sequences per step; max_len: padded sequence length ``S`` (tokens).
      num_anchors: blocks per sequence (``docs/specs/dflash.md`` 3.3; ``~ S / block_size`` covers
        every position once per step on average).
      gamma: loss position decay (3.6; 7 for block size 16; <= 0: no decay).
      draft_vocab: 0 trains over the target's whole vocabulary; ``Vd > 0`` over the ``Vd``
        tokens most frequent in the data's responses (:mod:`dflash_jax.drafter.vocab`), which the
        exported drafter then drafts over.
      lr: peak learning rate; warmup_ratio: fraction of ``steps`` of linear warmup from 0;
      decay: ``"cosine"``, ``"linear"`` or ``"constant"`` after warmup, down to
      ``lr * final_lr_ratio``.
      weight_decay, b1, b2, eps: AdamW (decoupled weight decay on every parameter).
      grad_clip: global-norm clip (0 = off).
      compute_dtype: ``"float32"`` or ``"bfloat16"`` forward/backward (master weights float32).
      seed: initialisation, anchor sampling and data order.
      init_scale: standard deviation of the random initial weights.
    """

    steps: int = 1000
    batch_size: int = 8
    max_len: int = 512
    num_anchors: int = 32
    gamma: float = 7.0
    draft_vocab: int = 0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    decay: str = "cosine"
    final_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    compute_dtype: str = "float32"
    seed: int = 0
    init_scale: float = 0.02

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise DFlashError("decay (--decay)", f"got {self.decay!r}", f"one of {DECAYS}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise DFlashError("compute_dtype (--dtype)", f"got {self.compute_dtype!r}", f"one of {COMPUTE_DTYPES}")
        for name in ("steps", "batch_size", "max_len", "num_anchors"):
            if int(getattr(self, name)) < 1:
                raise DFlashError(f"{name} (--{name.replace('_', '-')})", f"got {getattr(self, name)}", "an integer >= 1")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise DFlashError("warmup_ratio (--warmup-ratio)", f"got {self.warmup_ratio}", "a fraction in [0, 1)")
        if int(self.draft_vocab) < 0:
            raise DFlashError("draft_vocab (--draft-vocab)", f"got {self.draft_vocab}", "0 (the whole vocabulary) or a size >= 1")
        for name, ok, want in (("lr", self.lr > 0, "a number > 0"), ("gamma", True, "a finite number (<= 0: no decay)"),
                               ("weight_decay", self.weight_decay >= 0, "a number >= 0"),
                               ("grad_clip", self.grad_clip >= 0, "a number >= 0 (0: no clipping)"),
                               ("final_lr_ratio", 0 <= self.final_lr_ratio <= 1, "a fraction in [0, 1]")):
            if not (ok and math.isfinite(getattr(self, name))):
                raise DFlashError(f"{name} (--{name.replace('_', '-')})", f"got {getattr(self, name)}", want)


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    """Learning rate per step: linear warmup over ``round(warmup_ratio * steps)`` steps from 0,
    then ``tc.decay`` to ``lr * final_lr_ratio`` at ``steps``."""
    import optax

    warm = int(round(tc.warmup_ratio * tc.steps))
    rest = max(tc.steps - warm, 1)
    end = tc.lr * tc.final_lr_ratio
    if tc.decay == "cosine":
        after = optax.cosine_decay_schedule(tc.lr, rest, alpha=tc.final_lr_ratio)
    elif tc.decay == "linear":
        after = optax.linear_schedule(tc.lr, end, rest)
    else:
        after = optax.constant_schedule(tc.lr)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, tc.lr, warm), after], [warm])


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` then AdamW with :func:`lr_schedule`."""
    import optax

    adam = optax.adamw(lr_schedule(tc), b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adam) if tc.grad_clip > 0 else adam
