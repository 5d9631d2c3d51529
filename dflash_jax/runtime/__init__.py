"""Runtime pieces under every step: the carry's containers (pytrees with logical axes, KV caches and pages, capture buffers), compiled-program caches, sharding and several processes."""
