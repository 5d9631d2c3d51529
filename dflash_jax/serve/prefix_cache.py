"""Prefix reuse: the prefilled blocks of earlier prompts, kept on device and shared by requests.

Chat clients resend the same system prompt, and the whole conversation, every turn. The target's
K/V at positions ``[0, m)`` depend only on the tokens ``[0, m)`` (causal attention), and so does
the drafter's context there (the target features captured at those positions, projected). So the
engine keeps, for every block of :data:`BLOCK` prompt tokens it prefilled, that block's rows of
the target cache and of the drafter context, keyed by a hash of every token up to the block's end
(a chain: a block is reused only after the same tokens before it). A new prompt that starts with
cached blocks gets them copied into its row and is prefilled from the first block that is not
cached; it decodes as if it had prefilled them. The drafter's context travels with the K/V: a
reused prefix that brought the K/V alone would leave the drafter blind to it and acceptance would
collapse (vLLM #47930).

Blocks are evicted least recently used first within a byte budget. A prompt's last token is always
prefilled (its logits choose the first new token). Targets whose cache keeps sliding-window rings
(Laguna) hold no position-indexed K/V of a whole prefix: the cache stays off for them.
"""

from __future__ import annotations

import collections
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.runtime.carry import flat_axes
from dflash_jax.decode.state import DecodeState

BLOCK = 64
"""Prompt tokens per cached block (the smallest prefill chunk: blocks align with every chunk)."""


def _block_leaves(state: DecodeState) -> list[tuple[int, int, int]]:
    """``(leaf index, batch axis, seq axis)`` of every array of the target cache and the drafter
    context: the arrays that hold one entry per prompt position."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    out = []
    for i, (path, ax) in enumerate(zip(paths, flat_axes(state))):
        if path.startswith((".cache", ".speculative")) and "batch" in ax and "seq" in ax:
            out.append((i, ax.index("batch"), ax.index("seq")))
    return out


def supports(state: DecodeState) -> bool:
    """Whether every array of ``state``'s target cache has a position axis spanning the whole
    capacity (no sliding-window rings, no ring positions)."""
    return all("seq" in ax and x.shape[ax.index("seq")] == state.capacity
               for x, ax in zip(jax.tree_util.tree_leaves(state.cache), flat_axes(state.cache)))


@functools.partial(jax.jit, static_argnames=("size",))
def take_block(state: DecodeState, row, start, size: int = BLOCK) -> tuple:
    """One block of one row: for every array of :func:`_block_leaves` (the target cache's K/V,
    ``[L, B, S, Hkv, D]``, and the drafter context, ``[Ld, B, S, Hkv, D]``), its positions
    ``[start, start + size)`` of row ``row`` (``[]`` int32 each), the batch axis dropped
    (``[L, size, Hkv, D]``, the array's dtype). Positions past the capacity are clamped by
    ``dynamic_slice``: callers take whole blocks inside a prompt."""
    flat = jax.tree_util.tree_leaves(state)
    return tuple(jnp.squeeze(jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_slice_in_dim(flat[i], row, 1, b), start, size, s), b)
                 for i, b, s in _block_leaves(state))


@functools.partial(jax.jit, donate_argnames=("state",))
def put_block(state: DecodeState, row, start, block: tuple) -> DecodeState:
    """``state`` (donated) with a :func:`take_block` ``block`` written into row ``row`` at positions
    ``[start, start + size)`` (``[]`` int32 each) of every array of :func:`_block_leaves`, cast
    to each array's dtype; everything else unchanged."""
    flat, tdef = jax.tree_util.tree_flatten(state)
    for (i, b, s), x in zip(_block_leaves(state), block):
        index = [jnp.int32(0)] * flat[i].ndim
        index[b], index[s] = row, start
        flat[i] = jax.lax.dynamic_update_slice(flat[i], jnp.expand_dims(x, b).astype(flat[i].dtype), index)
    return jax.tree_util.tree_unflatten(tdef, flat)


def chain_keys(prompt, limit: int) -> list[bytes]:
    """The keys of the whole blocks of ``prompt`` within its first ``limit`` tokens: block ``j``'s
    key hashes every token of ``prompt[: (j + 1) * BLOCK]``."""
    ids = np.asarray(prompt, np.int32)
    keys, h = [], hashlib.sha256()
    for j in range(min(limit, len(ids)) // BLOCK):
        h.update(ids[j * BLOCK : (j + 1) * BLOCK].tobytes())
        keys.append(h.copy().digest())
    return keys


class PrefixCache:
    """Blocks of prefilled prompts on device, least recently used first out (module docstring).

    Args:
      budget_bytes: the most bytes of blocks kept (``--prefix-cache-mb``); :attr:`bytes` holds
        the bytes kept now.
    """

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._blocks: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def cached(self, prompt) -> int:
        """Tokens at the start of ``prompt`` that cached blocks hold (a multiple of :data:`BLOCK`,
        at most ``len(prompt) - 1``); marks those blocks used."""
        n = 0
        for key in chain_keys(prompt, len(prompt) - 1):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            n += BLOCK
        return n

    def restore(self, state: DecodeState, prompts: list, upto: int) -> DecodeState:
        """``state`` (a fresh state of ``prompts``, donated) with the cached blocks of each prompt's
        first ``upto`` tokens (:meth:`cached` of each, at least) copied into its row."""
        for row, prompt in enumerate(prompts):
            for j, key in enumerate(chain_keys(prompt, upto)):
                state = put_block(state, jnp.int32(row), jnp.int32(j * BLOCK), self._blocks[key])
        return state

    def keep(self, state: DecodeState, prompts: list, upto: int) -> None:
        """Keeps the blocks of each prompt within its first ``upto`` tokens that are prefilled in
        ``state`` (row ``i`` holds ``prompts[i]``) and not kept yet, evicting the least recently
        used blocks beyond the budget."""
        for row, prompt in enumerate(prompts):
            for j, key in enumerate(chain_keys(prompt, min(upto, len(prompt)))):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                block = take_block(state, jnp.int32(row), jnp.int32(j * BLOCK))
                self._blocks[key] = block
                self.bytes += sum(x.nbytes for x in block)
        while self.bytes > self.budget and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.bytes -= sum(x.nbytes for x in block)
