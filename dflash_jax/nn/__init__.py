"""Pure layers: norms, rotary embeddings, attention, MLPs. Functions of arrays only."""
