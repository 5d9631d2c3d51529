"""dflash_jax: DFlash speculative decoding in pure-functional JAX."""
