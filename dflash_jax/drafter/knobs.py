"""z-lab's Gemma drafter knobs (``dflash_config``: ``input_embedding_scale``, ``output_multiplier``,
``final_logit_softcapping``) restated against the target family's embedding and head.

In z-lab's ``dflash`` package (``model.py``: ``_raw_input_embeddings``, ``compute_logits``) the knobs
act on the target's *raw* embedding rows and *raw* LM head: the block is embedded as
``embed_tokens.weight[ids] * input_embedding_scale`` and the draft logits are
``cap(lm_head(h) * output_multiplier)``. Our drafter reaches the target only through its family
(:attr:`dflash_jax.families.contract.FamilyModel.embed` / ``lm_head``), which already apply the family's own
embedding scale (Gemma: ``sqrt(H)``) and logit soft-cap; :class:`~dflash_jax.drafter.config.DrafterConfig`'s
knobs therefore act on the family's outputs, and :func:`knobs_through_family` converts a z-lab
config's values to those terms when a drafter is paired with its target
(:func:`dflash_jax.drafter.model.load_hf_drafter`).
"""

from __future__ import annotations

import dataclasses
from dflash_jax.errors import DFlashError


def family_embedding_scale(target_cfg) -> float:
    """The factor the target family's ``embed`` applies to raw embedding rows (the config's
    ``embedding_scale`` attribute; 1.0 for families without one)."""
    return float(getattr(target_cfg, "embedding_scale", 1.0))


def family_logit_softcap(target_cfg) -> float:
    """The target family's final-logit soft-cap (its config's ``final_logit_softcapping``; 0: none)."""
    return float(getattr(target_cfg, "final_logit_softcapping", 0.0) or 0.0)


def knobs_through_family(d, target_cfg, source: str = "drafter config"):
    """``d`` (a :class:`~dflash_jax.drafter.config.DrafterConfig` parsed from a z-lab ``config.json``) with its
    knobs restated against the family's ``embed`` / ``lm_head`` outputs (module docstring):
    ``input_embedding_scale / family scale``; with a family soft-cap, the drafter's own cap (which
    must equal it, with ``output_multiplier`` 1) dropped, since the family's ``lm_head`` applies it.

    Raises:
      DFlashError: a target with a logit soft-cap and a drafter whose ``final_logit_softcapping``
        differs from it or whose ``output_multiplier`` is not 1 (z-lab would cap other logits than
        the family's ``lm_head`` gives; names ``source`` and the field).
    """
    cap_t, cap = family_logit_softcap(target_cfg), d.final_logit_softcapping
    if cap_t > 0:
        if d.output_multiplier != 1.0:
            raise DFlashError(f"{source}: field dflash_config.output_multiplier", f"{d.output_multiplier} with a target soft-capping "
                              f"its logits at {cap_t}", "1.0 (the target family's lm_head applies the cap)")
        if cap != cap_t:
            raise DFlashError(f"{source}: field dflash_config.final_logit_softcapping", f"{cap or None}",
                              f"{cap_t} (the target's final_logit_softcapping, applied by its family's lm_head)")
        cap = 0.0
    return dataclasses.replace(d, input_embedding_scale=d.input_embedding_scale / family_embedding_scale(target_cfg),
                               final_logit_softcapping=cap)
