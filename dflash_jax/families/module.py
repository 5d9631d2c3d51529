"""The target families as Flax NNX modules: :class:`TargetModule` and one subclass per family.

A loaded target's :attr:`~dflash_jax.loading.Target.model` is its family's subclass over the
loaded parameter tree (:class:`~dflash_jax.nn.module.Weights`: one ``nnx.Param`` per weight, the
same buffers), its methods the family's model functions (:class:`~dflash_jax.families.contract.FamilyModel`).
The classes live here, not in each family's ``model.py``, so that importing a family (and
``dflash_jax``) imports no flax: the command line never builds a module, and ``import flax.nnx``
(which brings ``flax.linen`` and treescope with it) costs about 0.5 s of every warm run
(BENCHMARKS.md, "The models as Flax NNX modules"). Loading builds a module the first time
``.model`` is read.
"""

from __future__ import annotations

from dflash_jax.errors import DFlashError
from dflash_jax.families.contract import FamilyModel
from dflash_jax.families.dense import model as dense
from dflash_jax.families.gemma4 import model as gemma4
from dflash_jax.families.gpt_oss import model as gpt_oss
from dflash_jax.families.laguna import model as laguna
from dflash_jax.families.qwen3_5 import model as qwen3_5
from dflash_jax.families.qwen3_moe import model as qwen3_moe
from dflash_jax.nn.module import Weights


class TargetModule(Weights):
    """A target as a Flax NNX module: its weights as ``nnx.Param`` (:class:`~dflash_jax.nn.module.Weights`,
    named as its family's parameter tree), its family's model functions as methods over them.

    Each subclass below names its family with the class attribute ``family`` (its
    :class:`FamilyModel`); :meth:`of` picks it. The jitted steps read the module's ``nnx.State``
    as its parameter tree (:mod:`dflash_jax.nn.module`).

    Args:
      cfg: the family's static config (kept as a static attribute: part of the graph).
      params: the parameter tree (``family.param_specs(cfg)``'s shape, any layout), buffers shared.
      axes: its logical axes tree (``None``: params without axes metadata).
    """

    family: FamilyModel

    def __init__(self, cfg, params, axes=None):
        super().__init__(params, axes)
        self.cfg = cfg

    @staticmethod
    def of(family: FamilyModel, cfg, params, axes=None) -> "TargetModule":
        """The module of ``family``'s own subclass over ``params``. Raises DFlashError for a
        family with none (a new family adds its subclass here)."""
        for cls in TargetModule.__subclasses__():
            if cls.family is family:
                return cls(cfg, params, axes)
        raise DFlashError(f"{family.module}", "no TargetModule subclass with this family",
                          "class XTarget(TargetModule): family = MODEL in dflash_jax/families/module.py")

    def __call__(self, tokens, positions, cache, capture=None):
        """``(logits [B, T, V] float32, cache, capture)``: :attr:`FamilyModel.forward` (tokens
        ``[B, T]`` int32, positions ``[B, T]`` int32, the cache of :meth:`init_cache`)."""
        return self.family.forward(self.tree(), self.cfg, tokens, positions, cache, capture)

    def hidden_states(self, tokens, positions, cache, capture=None, tree=None):
        """``(hidden [B, T, H], cache, capture)``: :attr:`FamilyModel.forward_hidden`."""
        return self.family.forward_hidden(self.tree(), self.cfg, tokens, positions, cache, capture, tree)

    def embed_tokens(self, tokens):
        """``[B, T, H]``: the embedding the first decoder layer reads (:attr:`FamilyModel.embed`)."""
        return self.family.embed(self.tree(), self.cfg, tokens)

    def logits(self, hidden):
        """float32 ``[..., V]`` logits of final-normed ``hidden [..., H]`` (:attr:`FamilyModel.lm_head`)."""
        return self.family.lm_head(self.tree(), self.cfg, hidden)

    def init_cache(self, batch: int, capacity: int):
        """An empty cache of ``capacity`` slots per row (:attr:`FamilyModel.init_cache`)."""
        return self.family.init_cache(self.cfg, batch, capacity)


class DenseTarget(TargetModule):
    """Llama (SmolLM2, Llama 3), Mistral, Qwen2 and Qwen3 targets (:mod:`dflash_jax.families.dense.model`)."""

    family = dense.MODEL


class LagunaTarget(TargetModule):
    """Laguna targets (:mod:`dflash_jax.families.laguna.model`)."""

    family = laguna.MODEL


class Qwen3MoeTarget(TargetModule):
    """Qwen3-MoE targets (:mod:`dflash_jax.families.qwen3_moe.model`)."""

    family = qwen3_moe.MODEL


class GptOssTarget(TargetModule):
    """gpt-oss targets (:mod:`dflash_jax.families.gpt_oss.model`)."""

    family = gpt_oss.MODEL


class Qwen35Target(TargetModule):
    """Qwen3.5 hybrid targets (:mod:`dflash_jax.families.qwen3_5.model`)."""

    family = qwen3_5.MODEL


class Gemma4Target(TargetModule):
    """Gemma 4 targets (:mod:`dflash_jax.families.gemma4.model`)."""

    family = gemma4.MODEL
