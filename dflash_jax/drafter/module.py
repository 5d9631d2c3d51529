"""A DFlash drafter as a Flax NNX module: one class per drafter kind, its weights as ``nnx.Param``
(:class:`~dflash_jax.nn.module.Weights`, named as the kind's parameter tree), the draft pass and
context projection of :mod:`dflash_jax.drafter.model` as methods over them.

The drafter borrows the target's embedding and LM head, so its methods take the target's module
(:class:`~dflash_jax.families.contract.TargetModule`).
"""

from __future__ import annotations

from dflash_jax.drafter import config as drafter_config
from dflash_jax.drafter import model as drafter_model
from dflash_jax.errors import DFlashError
from dflash_jax.nn.module import Weights


class DrafterModule(Weights):
    """A drafter's weights (``nnx.Param`` each) and its model functions.

    Args:
      cfg: the static :class:`~dflash_jax.drafter.config.DrafterConfig` (a static attribute).
      params: its parameter tree (:func:`dflash_jax.drafter.model.param_specs`' shape), buffers shared.
      axes: its logical axes tree, or ``None``.
    """

    architecture: str

    def __init__(self, cfg, params, axes=None):
        super().__init__(params, axes)
        self.cfg = cfg

    @staticmethod
    def of(cfg, params, axes=None) -> "DrafterModule":
        """The module of ``cfg.architecture``'s class over ``params``. Raises DFlashError for an
        architecture with none."""
        for cls in DrafterModule.__subclasses__():
            if cls.architecture == cfg.architecture:
                return cls(cfg, params, axes)
        raise DFlashError("architecture", f"got {cfg.architecture!r}", f"one of {[c.architecture for c in DrafterModule.__subclasses__()]}")

    def context(self, features, positions):
        """``(k, v)``, each ``[Ld, B, T, Hkv, D]``: captured features ``[B, T, K*H]`` at positions
        ``[B, T]`` projected into every draft layer's context (:func:`dflash_jax.drafter.model.context_kv`)."""
        return drafter_model.context_kv(self.tree(), self.cfg, features, positions)

    def __call__(self, target, block_tokens, positions, ctx_k, ctx_v, ctx_len):
        """``[B, W, H]`` final-normed hidden states of one draft pass over ``block_tokens [B, W]``
        (``[anchor, MASK, ...]``) at ``positions [B, W]``, reading the context ``ctx_k``/``ctx_v``
        of :meth:`context` below ``ctx_len [B]`` (:func:`dflash_jax.drafter.model.forward`);
        ``target``: the target's :class:`~dflash_jax.families.contract.TargetModule`."""
        t = target.tree()
        return drafter_model.forward(self.tree(), self.cfg, target.family, t, target.cfg, block_tokens, positions, ctx_k, ctx_v, ctx_len)

    def logits(self, target, hidden):
        """float32 draft logits ``[..., V]`` (``[..., Vd]`` over a draft vocabulary) of ``hidden``
        through the target's head (:func:`dflash_jax.drafter.model.logits`)."""
        return drafter_model.logits(self.tree(), self.cfg, target.family, target.tree(), target.cfg, hidden)


class DFlashDrafter(DrafterModule):
    """z-lab's ``DFlashDraftModel`` (:mod:`dflash_jax.drafter.generic`)."""

    architecture = drafter_config.DFLASH_DRAFTER


class DFlashLagunaDrafter(DrafterModule):
    """``DFlashLagunaForCausalLM`` (:mod:`dflash_jax.drafter.laguna`)."""

    architecture = drafter_config.LAGUNA_DRAFTER


class DFlash2Drafter(DrafterModule):
    """``DFlash2DraftModel``, with its candidate selector (:mod:`dflash_jax.drafter.dflash2`)."""

    architecture = drafter_config.DFLASH2_DRAFTER
