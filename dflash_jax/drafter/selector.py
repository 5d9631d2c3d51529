"""The DFlash2 candidate selector: a path through the drafter head's top-k tokens per slot, scored
pairwise with the token chosen before it.

At draft slot ``i`` the candidates are the ``k = selector_top_k`` best tokens of the draft logits
(after the drafter's ``output_multiplier`` and soft-cap: :func:`dflash_jax.drafter.model.logits`),
their logits the unary scores. With ``p`` the token chosen at the slot before (the verified
anchor for slot 0) and ``h_i`` the drafter's final hidden state at the slot::

    score_i(c) = logit_i(c) + < pred[p] * (h_i @ proj), succ[c] >

(``pred``/``succ``: the predecessor and successor codebooks ``[V, R]``, ``proj [H, R]``). Greedy
drafting takes ``argmax_c score_i`` and walks on from it; at temperature ``T > 0`` the slot's
distribution over its candidates is ``q_i = softmax(score_i / T)`` (z-lab applies no top-k/top-p
to it) and the draft is drawn from it before the walk goes on.

The draw uses the uniform of the draft's position (:mod:`dflash_jax.decode.sampling`), over the
candidates laid out in the target's vocabulary order, the order the target's own token is drawn
in with the same uniform: the two draws are coupled, so a draft is accepted exactly when it is the
target's sample, and what is committed is the target's sample whatever ``q`` is (``q`` is returned
for accept rules that need it, such as Leviathan/Chen rejection sampling).

Source: z-lab ``dflash/model.py`` (PyPI ``dflash==0.1.0``: ``CandidateSelector.select``,
``DFlash2DraftModel.propose``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.nn.quant import dot, take_rows


class SelectorInputs(NamedTuple):
    """What the selector scores, per row and draft slot.

    Attributes:
      unary: ``[B, n, k]`` float32 the candidates' draft logits, best first.
      candidates: ``[B, n, k]`` int32 their target token ids.
      hidden: ``[B, n, R]`` the drafter's hidden states through ``proj``.
    """

    unary: jnp.ndarray
    candidates: jnp.ndarray
    hidden: jnp.ndarray


def inputs(sel: dict, top_k: int, hidden: jnp.ndarray, logits: jnp.ndarray, ids: jnp.ndarray | None = None) -> SelectorInputs:
    """The top-``top_k`` candidates of ``logits [B, n, V']`` and the projected ``hidden [B, n, H]``.

    ``sel``: the selector's params (``proj``, ``pred``, ``succ``); ``ids [V']``: the target ids of
    the logits' columns (a draft vocabulary), else the columns are the ids.
    """
    unary, index = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    cand = (index if ids is None else jnp.take(ids, index)).astype(jnp.int32)
    return SelectorInputs(unary=unary, candidates=cand, hidden=dot(hidden, sel["proj"]))


def scores(sel: dict, x: SelectorInputs, slot, predecessor: jnp.ndarray) -> jnp.ndarray:
    """``[B, k]`` float32 scores of slot ``slot``'s candidates after ``predecessor [B]`` (module
    docstring). ``slot``: an int or ``[B]`` int32 (each row its own slot)."""
    rows = jnp.arange(x.unary.shape[0])
    unary, cand, h = x.unary[rows, slot], x.candidates[rows, slot], x.hidden[rows, slot]
    a = take_rows(sel["pred"], predecessor).astype(jnp.float32) * h.astype(jnp.float32)  # [B, R]
    b = take_rows(sel["succ"], cand).astype(jnp.float32)  # [B, k, R]
    return unary + jnp.einsum("br,bkr->bk", a, b)


def draw_in_vocab_order(q: jnp.ndarray, cand: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
    """The index ``[B]`` into ``k`` candidates drawn from ``q [B, k]`` by inverse transform with
    uniforms ``u [B]``, the candidates taken in increasing token id (``cand [B, k]``)."""
    order = jnp.argsort(cand, axis=-1)
    c = jnp.cumsum(jnp.take_along_axis(q, order, axis=-1), axis=-1)
    total = c[:, -1:]
    v = jnp.minimum(u[:, None] * total, jnp.nextafter(total, 0.0))
    j = jnp.minimum(jnp.sum(c <= v, axis=-1), q.shape[-1] - 1)
    return jnp.take_along_axis(order, j[:, None], axis=-1)[:, 0]


def select(sel: dict, x: SelectorInputs, anchor: jnp.ndarray, temperature: jnp.ndarray | None = None,
           uniforms: jnp.ndarray | None = None):
    """The selector's walk from the verified anchor (module docstring).

    Args:
      sel: the selector's params; x: :func:`inputs`.
      anchor: ``[B]`` int32 each row's verified token before the first draft slot.
      temperature: ``[B]`` float32 (``None`` or ``0``: greedy, the argmax of every slot).
      uniforms: ``[B, n]`` float32 the uniforms of the draft positions (needed where a row samples).
    Returns:
      ``(path [B, n] int32 drafted ids, q [B, n, k] float32)``: ``q`` is the slot's distribution
      over ``x.candidates`` (``softmax(score / T)``; one-hot at the argmax for a greedy row).
    """
    b, n, k = x.unary.shape
    t = jnp.zeros((b,), jnp.float32) if temperature is None else temperature.astype(jnp.float32)
    u = jnp.zeros((b, n), jnp.float32) if uniforms is None else uniforms
    rows = jnp.arange(b)

    def step(pred, i):
        s = scores(sel, x, i, pred)
        best = jnp.argmax(s, axis=-1)
        q = jax.nn.softmax(s / jnp.where(t > 0, t, 1.0)[:, None], axis=-1)
        q = jnp.where((t > 0)[:, None], q, jax.nn.one_hot(best, k, dtype=jnp.float32))
        j = jnp.where(t > 0, draw_in_vocab_order(q, x.candidates[:, i], u[:, i]), best)
        tok = x.candidates[rows, i, j]
        return tok, (tok, q)

    _, (path, q) = jax.lax.scan(step, anchor.astype(jnp.int32), jnp.arange(n))
    return path.T, jnp.moveaxis(q, 0, 1)
