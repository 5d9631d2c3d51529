"""The decode core, read in this order: state (a step's three arguments: the static Decoding, the
Params and the DecodeState carry), sampling, prefill, step (capture, propose, verify, commit), loop
(plain and speculative steps, the on-device loop, stream, continuous batching), tree, and auto/ (the
adaptive depth)."""
