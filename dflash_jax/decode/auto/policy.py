"""Adaptive verify depth (``n_max="auto"``): the policy that picks each step's verify width.

Every step the drafter drafts its whole block (``n = block_size - 1`` tokens) and reports a
confidence per position, its top probability ``c_i`` (a function of the drafter's distribution
only, never of the sampled draft or of the target). A per-position calibration, fitted on
observed acceptance (``dflash-jax calibrate-depth``), turns it into the probability that draft
``i`` is accepted when drafts ``1..i-1`` were: ``a_i = sigmoid(scale_i * logit(c_i) + bias_i)``.
The survival ``S_i = a_1 * ... * a_i`` is the probability that draft ``i`` is committed, so a
verify of ``w`` drafts commits ``E_b(w) = 1 + S_1 + ... + S_w`` tokens on row ``b`` in
expectation (the bonus token included; drafts a shortened final block cannot hold count 0).
With the measured seconds ``C(w)`` of a step that proposes and verifies ``w`` drafts
(:mod:`dflash_jax.decode.auto.costs`), the batch verifies the width that maximises
``sum_b E_b(w) / C(w)`` over its running rows (the DSpark / vLLM adaptive-verification rule).

Under ``tree=N`` the drafter's candidates form a best-first tree of ``N`` nodes
(:mod:`dflash_jax.decode.tree`) and the step chooses how many of its first nodes to verify
(:func:`tree_widths`), from :func:`tree_expected_tokens`, the same way.

The widths to choose from are few (:func:`verify_widths`: blocks of 2, 4, 8, ... tokens and the
whole block), because each is a target pass compiled into the step: eight widths made the step's
XLA:CPU executable 26 MB, which took 24 s to read back from the compilation cache on every run
(BENCHMARKS.md, "The cost of auto at the point of use"). Between two of them a width is not worth
its code: a verify of ``w`` drafts costs about what the next candidate costs (on XLA:CPU a pass of 4
to 8 tokens costs within a few percent of 8; on a GPU every width costs about the same), and
commits no more.

Each row also carries its online acceptance ``trust_b`` (``SpeculativeState.trust``, 1 at the
start): after every verify, a moving average (:data:`TRUST_RATE`) of the drafts the row accepted
over the drafts its calibrated confidences predicted (:func:`update_trust`). The rule reads
``1 + trust_b (E_b(w) - 1)`` (:func:`trusted`): a row whose text the drafter predicts worse than
its calibration says (chat, where the calibration was fitted on code) counts less within a few
steps, so a batch of such rows turns to plain steps, and one it predicts better counts more.

Drafting does not pay when even that best rate does not beat the rate of a plain step (one
token per running row per ``plain_cost`` seconds) by ``pay_margin`` (:data:`PAY_MARGIN` by
default). The step after such a propose is then a plain step (a target pass over the anchor
alone: no propose, one token), and the plain run doubles each time the next propose does not pay
either (1, 2, 4, then at most ``max_backoff`` steps: by default set from the measured costs,
:func:`dflash_jax.decode.auto.costs.probe_backoff`, :data:`MAX_BACKOFF` where drafting is cheap); a propose
that pays resets it. The choice is made on device, from drafter-side values and the history only,
so greedy output equals plain greedy decoding and sampled output keeps the target's distribution
exactly (the accept rule of each verified draft is unchanged).
"""

from __future__ import annotations

import dataclasses
import math
import jax
import jax.numpy as jnp
from dflash_jax.runtime import carry as pytree
from dflash_jax.runtime.carry import axes_field
from dflash_jax.errors import DFlashError


# The longest run of plain steps between two proposes, and the fraction by which drafting's
# expected rate must beat a plain step's (a guard against selection on an estimate: the steps
# chosen for drafting are those whose predictions came out high). Chosen side by side at 256 new
# tokens, the length users' answers reach (tools/bench_policy.py at commit 9868b87, BENCHMARKS.md "Policy
# constants", 2026-12-02): 8 and 0.05 against 16 and 0.15 gave 1.28x against 1.22x plain decoding
# on HumanEval and 1.00x against 1.00x on chat at batch 1, and 1.20x against 1.10x and 0.99x
# against 0.96x at batch 8. (Answers of 32 tokens had favoured 16 and 0.15 on chat, where each
# answer's first probes weigh more.) Both are fields of DepthPolicy (traced): another value
# recompiles nothing. MAX_BACKOFF is now the floor of the cost-derived cap below.
MAX_BACKOFF = 8
PAY_MARGIN = 0.05
# Where a drafting step costs several plain steps (a 2-core CPU), a propose whose drafts are all
# rejected loses most of one: the longest plain run there is set by the measured costs so that
# such a propose costs at most PROBE_LOSS of plain decoding's speed (costs.probe_backoff), from
# MAX_BACKOFF up to MAX_BACKOFF_LIMIT. 1 %, within the 0.99x of plain decoding that the default
# must keep where drafting does not pay: once the schedule goes on from one generation to the
# next (decode/auto/history.py), this cap, not each answer's first probes, sets what probing costs.
PROBE_LOSS = 0.01
MAX_BACKOFF_LIMIT = 256
# The weight of a step's observation in a row's online acceptance (update_trust): a row whose
# drafts are all rejected weighs its predictions at 1/2, 1/4, 1/8 after one, two, three steps;
# the factor stays within [0, TRUST_MAX].
TRUST_RATE = 0.5
TRUST_MAX = 2.0
_EPS = 1e-6


@pytree.dataclass
class DepthPolicy:
    """The numbers of the depth policy, one pytree (``Params.depth``; traced, so new costs or a
    new calibration never recompile).

    Attributes:
      scale, bias: ``[n]`` float32 calibration per draft position (identity: 1 and 0).
      bounds: ``[K]`` int32 upper bounds of the live-length buckets of the cost table,
        ascending (a live length beyond the last uses the last bucket).
      step_cost: ``[K, m]`` float32 seconds of a step that proposes and verifies ``w`` drafts,
        for the ``m`` widths the step chooses from (``Decoding.auto_widths``: :func:`verify_widths`
        of a chain, :func:`tree_widths` of a tree), per bucket.
      plain_cost: ``[K]`` float32 seconds of a plain step (no propose, one target token).
      max_backoff: ``[]`` int32 the longest run of plain steps between two proposes
        (:func:`~dflash_jax.decode.auto.costs.probe_backoff` of the costs unless set).
      pay_margin: ``[]`` float32 the fraction by which drafting's expected rate must beat a
        plain step's (:data:`PAY_MARGIN` unless set).
    """

    scale: jnp.ndarray = axes_field(None)
    bias: jnp.ndarray = axes_field(None)
    bounds: jnp.ndarray = axes_field(None)
    step_cost: jnp.ndarray = axes_field(None, None)
    plain_cost: jnp.ndarray = axes_field(None)
    max_backoff: jnp.ndarray = axes_field()
    pay_margin: jnp.ndarray = axes_field()


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per-position calibration of the drafter's confidences, shipped with a drafter.

    Attributes:
      scale, bias: one float per draft position (``block_size - 1``).
      record: how it was fitted (method, prompts, samples, errors before and after), as stored.
    """

    scale: tuple[float, ...]
    bias: tuple[float, ...]
    record: dict | None = dataclasses.field(default=None, compare=False)

    @staticmethod
    def identity(n: int) -> "Calibration":
        """The raw confidences as acceptance predictions (a drafter without a fitted calibration)."""
        return Calibration((1.0,) * n, (0.0,) * n)

    @staticmethod
    def from_record(record, n: int, where: str) -> "Calibration":
        """Parses a stored calibration ``{"scale": [n floats], "bias": [n floats], ...}``.

        Raises:
          DFlashError: naming ``where`` and the bad field.
        """
        if not isinstance(record, dict):
            raise DFlashError(where, f"got {type(record).__name__}", 'an object {"scale": [...], "bias": [...]}')
        out = {}
        for name in ("scale", "bias"):
            v = record.get(name)
            if not isinstance(v, list) or len(v) != n or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
                raise DFlashError(f"{where}.{name}", f"got {v!r}", f"a list of {n} finite numbers (one per draft position)")
            out[name] = tuple(float(x) for x in v)
        return Calibration(out["scale"], out["bias"], dict(record))


def verify_widths(n: int) -> tuple[int, ...]:
    """The verify widths (drafts verified) an adaptive step of ``n`` drafted tokens chooses
    from: ``1, 3, 7, ...`` below ``n`` (blocks of 2, 4, 8, ... tokens), then ``n`` (module
    docstring). ``n = 7``: ``(1, 3, 7)``; ``n = 3``: ``(1, 3)``; ``n = 1``: ``(1,)``.

    Raises:
      DFlashError: ``n < 1``.
    """
    if n < 1:
        raise DFlashError("n (drafted tokens)", f"got {n}", "at least 1")
    widths, w = [], 1
    while w < n:
        widths.append(w)
        w = 2 * w + 1
    return (*widths, n)


def tree_widths(nodes: int) -> tuple[int, ...]:
    """The widths (nodes verified) an adaptive step over a best-first tree of ``nodes`` nodes
    chooses from: :func:`verify_widths` of ``nodes`` from 3 nodes up (``3``: ``(3,)``; ``7``:
    ``(3, 7)``; ``15``: ``(3, 7, 15)``; fewer than 3 nodes: the whole tree). A tree of one node is
    a chain of one draft, and on the held-out prompts of BENCHMARKS.md ("Chains and trees of
    the same verify width") verifying one node besides the whole tree (or a plain step) gained
    about 1 % while its target pass made the compiled step a third larger.

    Raises:
      DFlashError: ``nodes < 1``.
    """
    return tuple(w for w in verify_widths(nodes) if w >= min(3, nodes))


def acceptance(policy: DepthPolicy, conf: jnp.ndarray) -> jnp.ndarray:
    """Calibrated acceptance predictions ``[B, n]`` of the confidences ``conf [B, n]``."""
    c = jnp.clip(conf.astype(jnp.float32), _EPS, 1.0 - _EPS)
    return jax.nn.sigmoid(policy.scale * (jnp.log(c) - jnp.log1p(-c)) + policy.bias)


def expected_tokens(policy: DepthPolicy, conf: jnp.ndarray, n_valid: jnp.ndarray) -> jnp.ndarray:
    """``E_b(w)``, ``[B, n + 1]``: tokens row ``b`` commits in expectation when ``w`` drafts are
    verified (``w = 0..n``); drafts beyond ``n_valid [B]`` (a shortened final block) count 0."""
    n = conf.shape[1]
    survival = jnp.cumprod(acceptance(policy, conf), axis=1) * (jnp.arange(n)[None, :] < n_valid[:, None])
    return 1.0 + jnp.concatenate([jnp.zeros_like(survival[:, :1]), jnp.cumsum(survival, axis=1)], axis=1)


def tree_expected_tokens(policy: DepthPolicy, tree, conf: jnp.ndarray, n_valid: jnp.ndarray) -> jnp.ndarray:
    """``E_b(w)``, ``[B, N + 1]``: tokens row ``b`` commits in expectation when the first ``w``
    nodes of a best-first tree (:class:`~dflash_jax.decode.tree.DraftTree`, ``N`` nodes) are
    verified, ``w = 0..N``.

    A node at slot ``d`` is the target's token there, its parent accepted, with probability
    ``a_d`` (the calibrated acceptance of slot ``d``'s top confidence ``conf[:, d]``) when it is
    the slot's top candidate, else ``(1 - a_d) * p / (1 - conf[:, d])``, its drafter probability
    ``p`` within the mass the top candidate leaves: the calibration says how often the top
    candidate is right, and when it is not the target's token falls as the drafter's other
    candidates do (the probabilities of all of a slot's tokens sum to 1). A node is accepted
    with the product of these along its path; drafts beyond ``n_valid [B]`` count 0. For a chain
    (every node a top candidate) this is :func:`expected_tokens`.
    """
    a_slot = acceptance(policy, conf)  # [B, n]
    d = jnp.maximum(tree.depth - 1, 0)
    a = jnp.take_along_axis(a_slot, d, axis=1)
    c = jnp.take_along_axis(conf.astype(jnp.float32), d, axis=1)
    p = jnp.where(tree.rank == 0, a, (1.0 - a) * tree.prob / jnp.maximum(1.0 - c, _EPS))
    on_path = tree.mask[:, 1:, 1:]  # [B, N, N]: j is i or an ancestor of i
    survival = jnp.prod(jnp.where(on_path, p[:, None, :], 1.0), axis=2)
    survival = survival * (tree.alive & (tree.depth <= n_valid[:, None]))
    return 1.0 + jnp.concatenate([jnp.zeros_like(survival[:, :1]), jnp.cumsum(survival, axis=1)], axis=1)


def trusted(expected: jnp.ndarray, trust: jnp.ndarray) -> jnp.ndarray:
    """``expected [B, m + 1]`` (tokens committed when ``w = 0..m`` drafts are verified) with each
    row's drafts weighed by its online acceptance ``trust [B]``: ``1 + trust_b (E_b(w) - 1)``,
    at most ``1 + w``. A row whose drafts the calibrated confidences overrate (text unlike the
    drafter's training) counts for less, one they underrate for more."""
    w = jnp.arange(expected.shape[1], dtype=jnp.float32)[None, :]
    return jnp.minimum(1.0 + trust[:, None] * (expected - 1.0), 1.0 + w)


def update_trust(trust, expected, w, accepted, verified):
    """Each row's online acceptance after a step (on device, no host round trip).

    Args:
      trust: ``[B]`` float32 before the step; expected: ``[B, m + 1]`` the untrusted expected
        tokens of the step's choice (:func:`expected_tokens` / :func:`tree_expected_tokens`);
      w: ``[]`` int32 the width verified; accepted: ``[B]`` int32 drafts each row accepted;
      verified: ``[B]`` bool rows whose drafts were verified (running, not a plain step).
    Returns:
      ``[B]`` float32: where a row's verified drafts were predicted to commit ``e = E_b(w) - 1``
      tokens, ``(1 - TRUST_RATE) trust + TRUST_RATE min(accepted / e, TRUST_MAX)``; unchanged
      elsewhere (no observation).
    """
    predicted = jnp.take(expected, w, axis=1) - 1.0
    seen = verified & (predicted > 0.05)
    ratio = jnp.minimum(accepted.astype(jnp.float32) / jnp.maximum(predicted, 0.05), TRUST_MAX)
    return jnp.where(seen, (1.0 - TRUST_RATE) * trust + TRUST_RATE * ratio, trust).astype(jnp.float32)


def bucket(policy: DepthPolicy, live: jnp.ndarray) -> jnp.ndarray:
    """The cost bucket ``[]`` int32 of the longest live row ``live`` (tokens)."""
    k = jnp.sum(policy.bounds < live).astype(jnp.int32)
    return jnp.minimum(k, policy.bounds.shape[0] - 1)


def choose_width(policy: DepthPolicy, conf, n_valid, running, live):
    """The verify width of the batch and whether drafting pays (a chain of drafts).

    Args:
      conf: ``[B, n]`` float32 drafter confidences; n_valid: ``[B]`` int32 drafts that may be
        accepted; running: ``[B]`` bool rows still decoding; live: ``[]`` int32 longest live row.
    Returns:
      ``(j [] int32, pays [] bool)``: ``verify_widths(n)[j]`` maximises expected committed tokens
      of the running rows per second; ``pays``: that rate beats plain decoding's by
      ``policy.pay_margin``.
    """
    return choose_from(policy, expected_tokens(policy, conf, n_valid), running, live, verify_widths(conf.shape[1]))


def choose_from(policy: DepthPolicy, expected, running, live, widths: tuple[int, ...]):
    """:func:`choose_width` from the expected tokens ``expected [B, m + 1]`` of verifying
    ``w = 0..m`` drafts (:func:`expected_tokens`, or :func:`tree_expected_tokens` of a tree's
    first ``w`` nodes): ``(j, pays)`` over the static ``widths`` (the policy's ``step_cost``
    columns: :func:`verify_widths` of a chain, :func:`tree_widths` of a tree)."""
    k = bucket(policy, live)
    widths = jnp.asarray(widths, jnp.int32)
    tokens = jnp.sum(jnp.where(running[:, None], expected, 0.0), axis=0)[widths]
    rate = tokens / policy.step_cost[k]
    j = jnp.argmax(rate).astype(jnp.int32)
    pays = rate[j] * policy.plain_cost[k] > (1.0 + policy.pay_margin) * jnp.sum(running)
    return j, pays


def schedule(policy: DepthPolicy, ctx, plain: jnp.ndarray, pays: jnp.ndarray):
    """The plain-step schedule after a step: a plain step uses one of ``plain_left``; a propose
    that pays resets the backoff, one that does not schedules ``backoff`` plain steps and doubles
    it (at most ``policy.max_backoff``). Returns the updated speculative state."""
    plain_left = jnp.where(plain, ctx.plain_left - 1, jnp.where(pays, 0, ctx.backoff))
    backoff = jnp.where(plain, ctx.backoff, jnp.where(pays, 1, jnp.minimum(2 * ctx.backoff, policy.max_backoff)))
    return ctx.replace(plain_left=plain_left.astype(jnp.int32), backoff=backoff.astype(jnp.int32))


def check_depth_policy(policy, static) -> None:
    """Checks ``Params.depth`` under ``n_max="auto"`` against ``static`` (the
    :class:`~dflash_jax.decode.state.Decoding`), at trace time: shapes only; the steps that choose
    a width call it, prefill does not need a policy. One calibration per drafted position
    (``static.depth``), one step cost per width of ``static.auto_widths``.

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
