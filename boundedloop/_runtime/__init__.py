"""What every layer uses: batching and `shard_map` support, run-time checks,
progress, flat leaves, and the one module that imports JAX internals. Imports
nothing of the package."""
