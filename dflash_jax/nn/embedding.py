"""The input embedding and output head every target family shares.

A target's params carry ``embed [V, H]`` and, untied or after
:func:`dflash_jax.loading.with_output_head`, ``lm_head [H, V]``; the drafters read the target's
through the family's :class:`~dflash_jax.family.FamilyModel` (these functions for the families
that neither scale the embedding nor soft-cap the logits).
"""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.nn import layouts


def embed(params: dict, cfg, tokens: jnp.ndarray) -> jnp.ndarray:
    """``[B, T]`` int32 -> ``[B, T, H]`` rows of ``params["embed"]`` in its dtype (no scaling;
    ``cfg`` unused: the family contract, :class:`dflash_jax.family.FamilyModel`)."""
    return jnp.take(params["embed"], tokens, axis=0)


def lm_head(params: dict, cfg, hidden: jnp.ndarray) -> jnp.ndarray:
    """Final-normed hidden ``[..., H]`` -> float32 logits ``[..., V]`` through ``params["lm_head"]
    [H, V]`` when present (or its ``[V, H]`` copy ``lm_head_t`` in a pass of
    :data:`~dflash_jax.nn.layouts.HEAD_MIN_ROWS` rows or more), else the tied embedding ``[V, H]``
    (``cfg`` unused: the model API)."""
    if "lm_head" in params:
        return layouts.project(hidden, params["lm_head"], params.get("lm_head_t"), layouts.HEAD_MIN_ROWS, jnp.float32)
    return jnp.einsum("...h,vh->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
