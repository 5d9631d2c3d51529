"""Pure layers, functions of arrays only: a decoder layer's pieces and the layer runner (layer),
attention (attention), parameter declarations and layouts (params), routed experts (moe) and
Gated DeltaNet (gated_deltanet)."""
