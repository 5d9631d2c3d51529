"""Writing captured target-layer residuals into a :class:`~dflash_jax.cache.Capture`, shared by
every target model's ``forward_hidden``.

Inside the layer loop the residual after each layer goes to row ``slot_of[layer]`` of a small
``[n + 1, B, T, H]`` stack (row ``n`` is scratch for layers not captured); after the loop
:func:`write` scatters the listed layers' rows, concatenated in the listed order, into
``capture.hidden`` at ``position - base``.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.cache import Capture, write_rows
from dflash_jax.errors import DFlashError


def slots(capture: Capture | None, n_layers: int) -> np.ndarray:
    """``[n_layers]`` int32: the stack row of each layer's residual (``len(layer_ids)`` for layers
    not captured; all zeros without a capture).

    Raises:
      DFlashError: a capture layer id outside ``[0, n_layers)``.
    """
    if capture is None:
        return np.zeros((n_layers,), np.int32)
    n = len(capture.layer_ids)
    out = np.full((n_layers,), n, np.int32)
    for s, i in enumerate(capture.layer_ids):
        if not 0 <= i < n_layers:
            raise DFlashError("capture layer_ids", f"layer id {i} is out of range for a {n_layers}-layer target",
                              f"ids in [0, {n_layers})")
        out[i] = s
    return out


def stack(capture: Capture | None, x: jnp.ndarray) -> jnp.ndarray:
    """The empty residual stack ``[n + 1, B, T, H]`` for hidden ``x [B, T, H]`` (a ``[1, 1, 1, 1]``
    placeholder without a capture)."""
    if capture is None:
        return jnp.zeros((1, 1, 1, 1), x.dtype)
    return jnp.zeros((len(capture.layer_ids) + 1,) + x.shape, x.dtype)


def keep(capture: Capture | None, cap: jnp.ndarray, x: jnp.ndarray, slot) -> jnp.ndarray:
    """``cap`` with a layer's output ``x [B, T, H]`` in row ``slot`` (traced or static int); unchanged
    without a capture."""
    if capture is None:
        return cap
    return lax.dynamic_update_index_in_dim(cap, x, slot, 0)


def write(capture: Capture | None, cap: jnp.ndarray, positions: jnp.ndarray, n_layers: int,
          final_norm: Callable[[jnp.ndarray], jnp.ndarray], valid: jnp.ndarray | None = None) -> Capture | None:
    """The capture with the stacked rows written.

    Args:
      capture: the :class:`Capture` (``None``: returned as is).
      cap: ``[n + 1, B, T, H]`` stack filled by :func:`keep`.
      positions: ``[B, T]`` int32 absolute positions; row ``t`` lands at ``positions - base``
        (rows before ``base`` or past the buffer are dropped).
      n_layers: the target's layer count.
      final_norm: the target's final norm, applied to the last layer's rows when
        ``capture.post_norm_last`` and that layer is captured.
      valid: optional ``[B, T]`` bool; rows where False are not written (padding).
    Returns:
      the capture with ``hidden [B, N, n * H]`` updated.
    """
    if capture is None:
        return None
    cap = cap[:-1]
    if capture.post_norm_last and n_layers - 1 in capture.layer_ids:
        s = capture.layer_ids.index(n_layers - 1)
        cap = cap.at[s].set(final_norm(cap[s]))
    feats = jnp.moveaxis(cap, 0, 2)  # [B, T, n, H]
    feats = feats.reshape(feats.shape[0], feats.shape[1], -1)
    idx = positions - capture.base[:, None]
    drop = idx < 0 if valid is None else (idx < 0) | ~valid
    return capture.replace(hidden=write_rows(capture.hidden, feats, jnp.where(drop, capture.hidden.shape[1], idx)))
