"""The user's functions as data: the traced loop (`TracedLoop`, `LoopConfig`),
closures, perturbation, buffers and their indices, dtypes, and the checks of
what the functions return. Imports `_runtime`."""
