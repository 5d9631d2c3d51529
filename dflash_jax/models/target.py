"""Dispatch from a target config to its forward functions (static, resolved at trace time)."""

from __future__ import annotations

from dflash_jax.config import TargetConfig
from dflash_jax.config_laguna import LagunaConfig
from dflash_jax.models import dense, laguna


def module_for(cfg):
    """The model module implementing ``forward_hidden``, ``lm_head``, ``embed`` and ``init_cache``."""
    if isinstance(cfg, TargetConfig):
        return dense
    if isinstance(cfg, LagunaConfig):
        return laguna
    raise TypeError(f"no target model for config type {type(cfg).__name__}")
