"""The loops that run (see `docs/architecture.md`). Imports `_tracing` and
`_runtime`."""
