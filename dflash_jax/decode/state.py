"""What every decode step takes, ``f(params, state, static, ...)``: the static set-up, the weights
and the carry.

- ``static``: a :class:`Decoding`, frozen and hashable, so that it is a static argument of every
  jitted step (one compile per decoding set-up): the configs, the draft mode and depth, the tree.
- ``params``: a :class:`Params` pytree (target and drafter weights, the depth policy's numbers).
- ``state``: the :class:`DecodeState` carry, one pytree holding everything that changes during a
  generation, donated to every step.

Positions, masks and rollback all derive from ``DecodeState.length``. The target KV cache holds K/V
for positions ``[0, length - 1)``: the last committed token has not been fed to the target yet (it
is the next decode input, or the anchor of the next speculative block).
:class:`SpeculativeState` is its speculative extension (``state.speculative``): the drafter's
context K/V, the statistics of the verify steps and, under ``n_max="auto"``, the captured features
of plain steps not yet projected into the context (:data:`PENDING_ROWS`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.decode import logprobs as token_logprobs
from dflash_jax.decode.sampling import (
    RowSampling,
    SamplingConfig,  # only to name it in an error
)
from dflash_jax.drafter.config import DrafterConfig, check_drafter_fits
from dflash_jax.errors import DFlashError
from dflash_jax.families.registry import family_of
from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import KVCache, PagedKVCache, axes_field, init_kv_cache

DRAFT_MODES = ("argmax", "sample", "reject")
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

    def trees(self) -> "Params":
        """These params with the weights as the parameter trees the model functions read: an
        ``nnx.State`` (:meth:`~dflash_jax.loading.Target.state` once ``.model`` was read) becomes
        its tree (:func:`dflash_jax.nn.module.tree_of`, the same arrays). Run at trace time."""
        if all(w is None or isinstance(w, dict) for w in self[:2]):
            return self
        from dflash_jax.nn.module import tree_of  # flax is imported: only it makes such values
        return self._replace(target=tree_of(self.target), drafter=tree_of(self.drafter))


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
        :mod:`dflash_jax.decode.sampling`; a greedy row proposes the argmax), or ``"reject"``
        (drafts drawn as ``"sample"`` draws them, accepted by the standard rejection rule instead
        of sample-and-match: :func:`dflash_jax.decode.step.reject_rule`; a chain of a fixed
        ``n_max``, a drafter without a selector; a sampled row's output then depends on its seed
        and on the drafter and ``n_max``, no longer equal to plain decoding's sample).
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
      logprobs: ``None`` (default: nothing recorded, the steps' programs unchanged), or record the
        target's log-probability of every committed token and its ``logprobs`` best alternatives
        (an integer in ``[0, 20]``) in ``DecodeState.logprobs`` (:mod:`dflash_jax.decode.logprobs`).
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
    logprobs: int | None = None

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
        top = token_logprobs.MAX_TOP_LOGPROBS
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, numbers.Integral)
                                          or not 0 <= self.logprobs <= top):
            raise DFlashError("logprobs", f"got {self.logprobs!r}", f"None (off) or an integer in [0, {top}] (alternatives per token)")
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
        if self.draft_mode == "reject" and (self.n_max == AUTO or self.drafter.selector_top_k > 0):
            got = "a DFlash2 drafter (a selector)" if self.n_max != AUTO else "n_max='auto'"
            raise DFlashError("draft_mode", f"'reject' with {got}", "a fixed n_max (an integer) and a drafter without a selector, "
                              "or draft_mode 'sample'")

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
        from dflash_jax.decode.auto import (
            policy as depth,  # the package's steps import this module
        )

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
        raise DFlashError("static", f"got {type(static).__name__}", "a dflash_jax.decode.state.Decoding(target_cfg, drafter_cfg, ...); steps are f(params, state, static)")
    if params is not None and not isinstance(params, Params):
        raise DFlashError("params", f"got {type(params).__name__}", "a dflash_jax.decode.state.Params(target_params, drafter_params); steps are f(params, state, static)")
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
    lp = getattr(state, "logprobs", None)
    if (lp is None) != (static.logprobs is None) or (lp is not None and lp.k != static.logprobs):
        got = "no log-probability buffer" if lp is None else f"a log-probability buffer of {lp.k} alternatives"
        raise DFlashError("decode state", f"{got} under a Decoding with logprobs={static.logprobs}", "a state from init_state with the same Decoding")


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

# finish codes, per row
RUNNING, STOP, LENGTH, CAPACITY = 0, 1, 2, 3
FINISH_REASONS = {RUNNING: None, STOP: "stop", LENGTH: "length", CAPACITY: "capacity"}


@pytree.dataclass
class DecodeState:
    """Decode carry for a batch of ``B`` rows with capacity ``S`` tokens each.

    Attributes:
      tokens: ``[B, S]`` int32 prompt then committed tokens.
      length: ``[B]`` int32 tokens committed per row (prompt included).
      prompt_len: ``[B]`` int32.
      max_new: ``[B]`` int32 new-token budget per row.
      stop_ids: ``[B, n]`` int32 ids that end each row (EOS and stop ids; ``-1`` pads).
      cache: target :class:`KVCache`; slots ``[0, length - 1)`` are committed between steps.
      rng: ``[B]`` PRNG keys, one per row, never split: the token at index ``t`` of row ``b`` is
        drawn with the uniform of ``fold_in(rng[b], t)`` (:func:`dflash_jax.decode.sampling.sample_at`).
      sampling: :class:`~dflash_jax.decode.sampling.RowSampling`, each row's temperature, top-k, top-p.
      finish: ``[B]`` int32 finish code (``RUNNING``, ``STOP``, ``LENGTH``, ``CAPACITY``).
      gaps: ``[B, S]`` float32 top-2 logit gap of the target step that chose each token.
      steps: ``[]`` int32 target passes after prefill (decode steps or verify steps).
      speculative: :class:`~dflash_jax.decode.state.SpeculativeState` (drafter context and
        statistics) with a drafter, else ``None``.
      logprobs: :class:`~dflash_jax.decode.logprobs.TokenLogprobs` of the committed tokens under
        ``Decoding(logprobs=k)``, else ``None``.
    """

    tokens: jnp.ndarray = axes_field("batch", "seq")
    length: jnp.ndarray = axes_field("batch")
    prompt_len: jnp.ndarray = axes_field("batch")
    max_new: jnp.ndarray = axes_field("batch")
    stop_ids: jnp.ndarray = axes_field("batch", None)
    cache: KVCache  # its own fields declare their axes (as speculative's do)
    rng: jax.Array = axes_field("batch")
    sampling: RowSampling  # its own fields declare their axes
    finish: jnp.ndarray = axes_field("batch")
    gaps: jnp.ndarray = axes_field("batch", "seq")
    steps: jnp.ndarray = axes_field()
    speculative: Any = None
    logprobs: Any = None

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    @property
    def done(self) -> jnp.ndarray:
        """``[B]`` bool: the row has finished (``finish != RUNNING``); a done row never changes again."""
        return self.finish != RUNNING

    @property
    def committed(self) -> jnp.ndarray:
        """``[B]`` int32 tokens committed by the steps after prefill (decode or verify steps, bonus
        tokens included; the first token, chosen by prefill, is not counted)."""
        return jnp.maximum(self.length - self.prompt_len - 1, 0)

    @property
    def new_tokens(self) -> jnp.ndarray:
        """``[B]`` int32 generated tokens per row."""
        return self.length - self.prompt_len


def commit(state: DecodeState, new: jnp.ndarray, n_new: jnp.ndarray, gaps: jnp.ndarray, logprobs=None) -> DecodeState:
    """Appends up to ``n_new[b]`` of ``new[b]`` to each running row, stopping exactly at the limits.

    A row keeps tokens up to and including its first stop id, never more than its remaining
    ``max_new`` budget, and never past capacity; done rows are untouched. The finish code records
    which limit ended the row (stop first, then length, then capacity).

    Args:
      state: the decode state.
      new: ``[B, K]`` int32 candidate tokens in order.
      n_new: ``[B]`` int32 how many leading candidates are proposed for commit (``1..K``).
      gaps: ``[B, K]`` float32 top-2 logit gaps of the steps that chose them.
      logprobs: their :class:`~dflash_jax.decode.logprobs.TokenLogprobs` (``[B, K]`` slots), written
        to ``state.logprobs`` when the state records them (``None`` otherwise).
    Returns:
      The state with ``tokens``, ``gaps``, ``length``, ``finish`` (and ``logprobs``) updated.
    """
    b, k = new.shape
    idx = jnp.arange(k, dtype=jnp.int32)[None, :]
    cand = (idx < n_new[:, None]) & ~state.done[:, None]
    is_stop = jnp.any(new[:, :, None] == state.stop_ids[:, None, :], axis=-1) & cand
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), k)
    budget = jnp.minimum(state.max_new - state.new_tokens, state.capacity - state.length)
    keep = cand & (idx <= first_stop[:, None]) & (idx < budget[:, None])
    n_keep = jnp.sum(keep, axis=1).astype(jnp.int32)
    pos = jnp.where(keep, state.length[:, None] + idx, state.capacity)
    rows = jnp.arange(b)[:, None]
    tokens = state.tokens.at[rows, pos].set(new.astype(jnp.int32), mode="drop")
    all_gaps = state.gaps.at[rows, pos].set(gaps.astype(jnp.float32), mode="drop")
    length = state.length + n_keep
    stopped = jnp.any(is_stop & keep, axis=1)
    finish = jnp.where(
        state.done,
        state.finish,
        jnp.where(
            stopped,
            STOP,
            jnp.where(length - state.prompt_len >= state.max_new, LENGTH, jnp.where(length >= state.capacity, CAPACITY, RUNNING)),
        ),
    ).astype(jnp.int32)
    if state.logprobs is not None:
        state = state.replace(logprobs=token_logprobs.write(state.logprobs, rows, pos, logprobs))
    return state.replace(tokens=tokens, gaps=all_gaps, length=length, finish=finish)


PENDING_ROWS = 16
"""Plain steps of ``n_max="auto"`` whose captured features wait in ``SpeculativeState.pending``
for one projection into the drafter context (:func:`dflash_jax.decode.auto.adaptive.absorb_pending`:
when full, or before a propose). Projecting a token reads the drafter's projection weights (7 MB in
float32 for the shipped drafter, 1.3 % of the 540 MB a plain step reads): once per this many steps."""


@pytree.dataclass
class SpeculativeState:
    """Drafter context and acceptance statistics, carried in ``DecodeState.speculative``.

    Context slot ``p`` holds the projected K/V of the committed token at position ``p``; slots
    ``[0, length - 1 - pending_n)`` are valid (the anchor's hidden state is not known before it is
    verified; the last ``pending_n`` positions before it wait in ``pending``). Only committed rows
    are ever inside that range: rows written by a verify beyond the accepted prefix are masked out
    and overwritten by the next verify. Tokens committed by verify steps are not stored: they are
    :attr:`dflash_jax.decode.state.DecodeState.committed`.

    Attributes:
      context: the drafter context K/V, a :class:`~dflash_jax.runtime.carry.KVCache` ``[Ld, B, S, Hkv, D]``
        or, in a paged batch, a :class:`~dflash_jax.runtime.carry.PagedKVCache` addressed by the same page
        tables as the target cache (:attr:`ctx_k` / :attr:`ctx_v` read its arrays).
      verify_steps: ``[B]`` int32 target passes while the row was running (the plain steps of
        ``n_max="auto"`` included: a verify of the anchor alone).
      drafted: ``[B]`` int32 draft tokens proposed to the target.
      accepted: ``[B]`` int32 draft tokens accepted and kept.
      accepted_per_position: ``[B, n]`` int32 steps in which draft position ``i + 1`` was
        accepted and kept (``n``: the drafted depth, ``Decoding.depth``).
      widths: ``[m + 1]`` int32 batch steps that proposed and verified ``w`` drafts (a tree's
        nodes under ``tree=``), ``w = 0..m`` (``m``: ``Decoding.verify_top``; with a fixed
        ``n_max`` every step counts at ``m``; the other steps of ``DecodeState.steps`` are plain
        steps).
      plain_left: ``[]`` int32 plain steps to take before the next propose (``auto``).
      backoff: ``[]`` int32 plain steps that the next propose that does not pay schedules (``auto``).
      trust: ``[B]`` float32 each row's online acceptance (``auto``): a moving average of the
        drafts it accepted over the drafts its calibrated confidences predicted, 1 at the start
        (:func:`dflash_jax.decode.auto.policy.update_trust`).
      pending: ``[B, PENDING_ROWS, K*H]`` (the target's dtype) the captured features of positions
        ``length - 1 - pending_n + t``, ``t < pending_n``, not yet in the context (``auto``, else ``None``).
      pending_n: ``[B]`` int32 rows of ``pending`` in use (``auto``, else ``None``).
    """

    context: KVCache | PagedKVCache  # its own fields declare their axes
    verify_steps: jnp.ndarray = axes_field("batch")
    drafted: jnp.ndarray = axes_field("batch")
    accepted: jnp.ndarray = axes_field("batch")
    accepted_per_position: jnp.ndarray = axes_field("batch", None)
    widths: jnp.ndarray = axes_field(None)
    plain_left: jnp.ndarray = axes_field()
    backoff: jnp.ndarray = axes_field()
    trust: jnp.ndarray = axes_field("batch")
    pending: jnp.ndarray | None = axes_field("batch", None, None, default=None)  # rows are not positions: no "seq"
    pending_n: jnp.ndarray | None = axes_field("batch", default=None)

    @property
    def ctx_k(self) -> jnp.ndarray:
        return self.context.k

    @property
    def ctx_v(self) -> jnp.ndarray:
        return self.context.v

    @property
    def n_max(self) -> int:
        """Draft positions tracked: the drafted depth."""
        return self.accepted_per_position.shape[1]


def init_speculative_state(cfg: DrafterConfig, batch: int, max_len: int, n_max: int, top: int | None = None,
                           pending_dtype=None) -> SpeculativeState:
    """Empty context of ``max_len`` slots and zeroed statistics for ``n_max`` draft positions and
    verifies of up to ``top`` drafts (a tree's nodes; ``None``: ``n_max``); with ``pending_dtype``
    (the target's dtype, under ``n_max="auto"``) an empty buffer of :data:`PENDING_ROWS` captured rows."""
    def zeros():  # distinct buffers: the state is donated
        return jnp.zeros((batch,), jnp.int32)

    width = len(cfg.target_layer_ids) * cfg.hidden_size
    pending, pending_n = (None, None) if pending_dtype is None else (jnp.zeros((batch, PENDING_ROWS, width), pending_dtype), zeros())
    return SpeculativeState(
        context=init_kv_cache(cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype), verify_steps=zeros(),
        drafted=zeros(), accepted=zeros(), accepted_per_position=jnp.zeros((batch, n_max), jnp.int32),
        widths=jnp.zeros(((top or n_max) + 1,), jnp.int32), plain_left=jnp.zeros((), jnp.int32),
        backoff=jnp.ones((), jnp.int32), trust=jnp.ones((batch,), jnp.float32),
        pending=pending, pending_n=pending_n,
    )
