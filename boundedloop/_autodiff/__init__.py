"""The loop's derivatives: its custom JVP, the primitives (`loop_jvp_p`,
`loop_tangent_p`) with their rules, and reverse over anything (second order).
Imports `_sweeps`, `_tracing` and `_runtime`."""
