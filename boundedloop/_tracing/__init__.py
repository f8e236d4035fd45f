"""The user's functions as data (see `docs/architecture.md`). Imports `_runtime`."""
