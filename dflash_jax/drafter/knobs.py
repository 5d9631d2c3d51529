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
    ``input_embedding_scale / family scale``. With a family soft-cap: a drafter whose own cap equals
    it with ``output_multiplier`` 1 has its cap dropped (the family's ``lm_head`` applies it, as
    z-lab would); any other drafter (its cap unset, so z-lab does not cap the draft logits, or
    another cap or multiplier) drafts through the raw head (``raw_head``: the family's cap off, the
    drafter's multiplier and own cap applied, as z-lab's ``compute_logits`` does).

    ``source`` is kept for the messages of callers that check more; nothing here is refused.
    """
    cap_t, cap = family_logit_softcap(target_cfg), d.final_logit_softcapping
    raw = False
    if cap_t > 0:
        if d.output_multiplier == 1.0 and cap == cap_t:
            cap = 0.0
        else:
            raw = True
    return dataclasses.replace(d, input_embedding_scale=d.input_embedding_scale / family_embedding_scale(target_cfg),
                               final_logit_softcapping=cap, raw_head=raw)
