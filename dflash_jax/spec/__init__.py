"""DFlash speculative decoding: drafter context, propose, verify (accept rules) and the loop."""
