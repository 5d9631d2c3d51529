"""The static part of a decode step, in one frozen object, and the parameters in one pytree.

Every step has the same signature, ``f(params, state, static, ...)``: ``params`` is a
:class:`Params` pytree (target and drafter weights), ``state`` the
:class:`~dflash_jax.decode.state.DecodeState` carry and ``static`` a :class:`Decoding`, hashable, so that
it is a static argument of every jitted step (one compile per decoding set-up).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple
from dflash_jax.drafter.config import DrafterConfig, check_drafter_fits
from dflash_jax.errors import DFlashError
from dflash_jax.families.registry import family_of
from dflash_jax.decode.sampling import SamplingConfig  # only to name it in an error


DRAFT_MODES = ("argmax", "sample")
AUTO = "auto"
MAX_TREE_NODES = 15
"""The most drafted nodes of a verified tree: a 16-token target pass (a Laguna target's
``max_block`` bounds it too)."""


class Params(NamedTuple):
    """The weights a step reads: the target's parameter pytree, the drafter's (``None`` for
    plain decoding) and, under ``n_max="auto"``, the depth policy's numbers (a
    :class:`~dflash_jax.decode.auto.policy.DepthPolicy`: calibration and measured costs). A
    pytree, so it is one argument of every jitted step."""

    target: Any
    drafter: Any = None
    depth: Any = None


@dataclasses.dataclass(frozen=True)
class Decoding:
    """What a decode step does, fixed for a whole generation (hashable: a static jit argument).

    Attributes:
      target: the target config (``TargetConfig`` or ``LagunaConfig``).
      drafter: a :class:`~dflash_jax.drafter.config.DrafterConfig` for DFlash speculative decoding, or
        ``None`` for plain decoding.
      draft_mode: ``"argmax"`` (propose the drafter's argmax; default, docs/specs/dflash.md 2.2)
        or ``"sample"`` (draw each draft from the drafter's distribution warped by the row's
        sampling settings, with the uniform the target's token at its position is drawn with,
        :mod:`dflash_jax.decode.sampling`; a greedy row proposes the argmax).
      n_max: drafted tokens verified per block, in ``[1, block_size - 1]``; ``None`` resolves to
        ``block_size - 1`` with a drafter (and must stay ``None`` without one). ``"auto"``: the
        drafter drafts ``auto_depth`` tokens and every step chooses, on device, how many of
        them to verify, or whether to skip the propose (:mod:`dflash_jax.decode.auto.policy`;
        the step then needs ``Params.depth``).
      auto_depth: under ``"auto"``, the tokens drafted per block, the widest verify (an integer
        in ``[1, block_size - 1]``; ``None``: ``block_size - 1``). Fewer drafts mean fewer verify
        widths to compile (:func:`~dflash_jax.decode.auto.policy.verify_widths`); a drafter may
        record its own (:attr:`dflash_jax.loading.Drafter.auto_depth`).
      tree: tree verification with this many drafted nodes per step (an integer in
        ``[1, MAX_TREE_NODES]``; the target verifies ``tree + 1`` tokens), built best-first from
        the drafter's top candidates at each of its ``n_max`` slots
        (:mod:`dflash_jax.decode.tree`); ``None``: a chain of ``n_max`` drafts. Needs
        ``draft_mode="argmax"``. Under ``n_max="auto"`` the tree is ``auto_depth`` deep and every
        step chooses how many of its first nodes to verify (the first ``w`` nodes of a best-first
        tree are the best tree of ``w`` nodes), or a plain step.
    The sampling settings are not here: they are each row's, in the decode state
    (:func:`dflash_jax.decode.loop.init_state`'s ``sampling``), so one compiled step serves any mix.

    Raises:
      DFlashError: a drafter that does not fit the target, a bad ``n_max``, ``auto_depth`` or
        ``draft_mode`` (a ``SamplingConfig`` in its place names ``init_state``), ``n_max`` without a
        drafter or ``auto_depth`` without ``n_max="auto"``, a bad ``tree`` or one that does not go
        with the other settings.
    """

    target: Any
    drafter: Any = None
    draft_mode: str = "argmax"
    n_max: int | str | None = None
    auto_depth: int | None = None
    tree: int | None = None

    def __post_init__(self):
        if isinstance(self.draft_mode, SamplingConfig):
            raise DFlashError("draft_mode", f"got {self.draft_mode!r}", "'argmax' or 'sample'; sampling settings are the rows': "
                              "decode.init_state(..., sampling=SamplingConfig(...))")
        family_of(self.target)  # a registered target config (DFlashError naming the types otherwise)
        if self.drafter is not None and not isinstance(self.drafter, DrafterConfig):
            raise DFlashError("drafter", f"got {type(self.drafter).__name__}", "a DrafterConfig (Drafter.cfg) or None")
        if self.draft_mode not in DRAFT_MODES:
            raise DFlashError("draft_mode", f"got {self.draft_mode!r}", f"one of {', '.join(DRAFT_MODES)}")
        if self.tree is not None:
            self._check_tree()
        if self.drafter is None:
            if self.n_max is not None:
                raise DFlashError("n_max (--n-max)", f"got {self.n_max} without a drafter (plain decoding drafts nothing)", "a drafter, or n_max=None")
            return
        check_drafter_fits(self.drafter, self.target)
        object.__setattr__(self, "n_max", check_n_max(self.drafter, self.n_max))
        if self.auto_depth is not None:
            top = self.drafter.block_size - 1
            if self.n_max != AUTO:
                raise DFlashError("auto_depth", f"got {self.auto_depth!r} with n_max={self.n_max!r}", "n_max='auto', or auto_depth=None")
            if isinstance(self.auto_depth, bool) or not isinstance(self.auto_depth, numbers.Integral) or not 1 <= self.auto_depth <= top:
                raise DFlashError("auto_depth", f"got {self.auto_depth!r}", f"an integer in [1, {top}] (block_size - 1)")

    def _check_tree(self):
        """Raises DFlashError for a ``tree`` that is not a node count or does not go with the rest."""
        if self.drafter is None:
            raise DFlashError("tree (--tree)", f"got {self.tree!r} without a drafter", "a drafter, or tree=None")
        if not family_of(self.target).model.trees:  # e.g. recurrent state: one per sequence, not per branch
            raise DFlashError("tree (--tree)", f"got tree={self.tree} with a {self.target.family} target",
                              "a chain (tree=None; 0 for generate and --tree): its linear-attention states follow one sequence")
        top = min(MAX_TREE_NODES, getattr(self.target, "max_block", MAX_TREE_NODES + 1) - 1)
        if isinstance(self.tree, bool) or not isinstance(self.tree, numbers.Integral) or not 1 <= self.tree <= top:
            raise DFlashError("tree (--tree)", f"got {self.tree!r}", f"an integer in [1, {top}] (drafted nodes per step), or a chain "
                              "(tree=None here; 0 for generate and --tree)")
        if self.draft_mode != "argmax":
            raise DFlashError("tree (--tree)", f"got tree={self.tree} with draft_mode={self.draft_mode!r}",
                              "draft_mode='argmax' (a tree holds the drafter's top candidates, not samples)")

    @property
    def speculative(self) -> bool:
        """Whether a drafter proposes blocks (DFlash) rather than one token per step (plain)."""
        return self.drafter is not None

    @property
    def adaptive(self) -> bool:
        """Whether every step chooses its verify width (``n_max="auto"``)."""
        return self.n_max == AUTO

    @property
    def depth(self) -> int:
        """Tokens drafted per block: ``n_max``, or under ``"auto"`` ``auto_depth`` (default
        ``block_size - 1``); 0 plain."""
        if self.drafter is None:
            return 0
        if self.adaptive:
            return self.auto_depth or self.drafter.block_size - 1
        return self.n_max

    @property
    def verify_top(self) -> int:
        """The most drafted tokens one verify pass holds: the tree's nodes, else the drafted depth
        (0 plain); the statistics' ``widths`` count steps by up to this many."""
        return self.tree or self.depth

    @property
    def auto_widths(self) -> tuple[int, ...]:
        """The widths (drafts, or a tree's first nodes, verified) a step of ``n_max="auto"``
        chooses from besides a plain step: :func:`~dflash_jax.decode.auto.policy.verify_widths`
        of the drafted depth, or :func:`~dflash_jax.decode.auto.policy.tree_widths` of the tree."""
        from dflash_jax.decode.auto import policy as depth  # the package's steps import this module

        return depth.tree_widths(self.tree) if self.tree else depth.verify_widths(self.depth)

    @property
    def width(self) -> int:
        """Tokens of a drafted block per row: ``depth + 1`` (anchor and drafts), or 1 (plain);
        the widest target pass of a step."""
        return self.depth + 1


def check_step_inputs(params, state, static) -> None:
    """Checks that a step's arguments go together (at trace time: types and pytree structure only).

    Args:
      params: a :class:`Params`; state: a :class:`~dflash_jax.decode.state.DecodeState` or ``None``
        (not checked); static: a :class:`Decoding`.
    Raises:
      DFlashError: an argument of the wrong type (the pre-0.2 orders ``f(params, cfg, state, ...)``
        included), drafter params missing under a drafter, or a state whose drafter context does
        not match ``static`` (none, or another ``n_max``).
    """
    if not isinstance(static, Decoding):
        raise DFlashError("static", f"got {type(static).__name__}", "a dflash_jax.decode.static.Decoding(target_cfg, drafter_cfg, ...); steps are f(params, state, static)")
    if params is not None and not isinstance(params, Params):
        raise DFlashError("params", f"got {type(params).__name__}", "a dflash_jax.decode.static.Params(target_params, drafter_params); steps are f(params, state, static)")
    if params is not None and static.speculative and params.drafter is None:
        raise DFlashError("params.drafter", "None under a Decoding with a drafter", "the drafter's params (Params(target.params, drafter.params))")
    if state is None:
        return
    ctx = getattr(state, "speculative", None)
    if not hasattr(state, "finish"):
        raise DFlashError("state", f"got {type(state).__name__}", "a DecodeState from dflash_jax.decode.loop.init_state")
    if static.speculative and (ctx is None or ctx.n_max != static.depth):
        got = "no drafter context" if ctx is None else f"a drafter context for n_max {ctx.n_max}"
        raise DFlashError("decode state", f"{got} under a Decoding with n_max {static.n_max}", "a state from init_state with the same Decoding")
    if not static.speculative and ctx is not None:
        raise DFlashError("decode state", "a drafter context under a Decoding without a drafter", "a state from init_state with the same Decoding")


def check_depth_policy(policy, static: Decoding) -> None:
    """Checks ``Params.depth`` under ``n_max="auto"`` (at trace time: shapes only; the steps
    that choose a width call it, prefill does not need a policy): one calibration per drafted
    position (``static.depth``), one step cost per width of ``static.auto_widths``.

    Raises:
      DFlashError: no policy, or one whose arrays do not fit ``static``.
    """
    how = "a DepthPolicy (dflash_jax.decode.auto.costs.depth_policy(calibration, cost_model)) in Params(..., depth=...)"
    if policy is None or not all(hasattr(policy, f) for f in ("scale", "bias", "bounds", "step_cost", "plain_cost", "max_backoff", "pay_margin")):
        raise DFlashError("params.depth", f"got {type(policy).__name__} under n_max='auto'", how)
    depth, widths = static.depth, static.auto_widths
    k = policy.bounds.shape[0]
    want = dict(scale=(depth,), bias=(depth,), bounds=(k,), step_cost=(k, len(widths)), plain_cost=(k,), max_backoff=(), pay_margin=())
    for name, shape in want.items():
        if tuple(getattr(policy, name).shape) != shape:
            raise DFlashError(f"params.depth.{name}", f"shape {tuple(getattr(policy, name).shape)}",
                              f"{shape} for {depth} drafted tokens and the verify widths {widths}")


def check_n_max(cfg_d, n_max: int | str | None) -> int | str:
    """Resolves the proposal depth: ``None`` means ``block_size - 1``; ``"auto"`` stays.

    Raises:
      DFlashError: ``n_max`` outside ``[1, block_size - 1]`` and not ``"auto"`` (names ``--n-max``).
    """
    top = cfg_d.block_size - 1
    if n_max is None:
        return top
    if n_max == AUTO:
        return AUTO
    if isinstance(n_max, bool) or not isinstance(n_max, numbers.Integral) or not 1 <= n_max <= top:
        raise DFlashError("n_max (--n-max)", f"got {n_max!r}", f"an integer in [1, {top}] (block_size - 1) or 'auto'")
    return int(n_max)
