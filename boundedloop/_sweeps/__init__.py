"""The loops that run: the forward sweeps, the reverse sweep and its
recomputation, one step and its VJP, the checkpoint store, the schedule and the
cost model that picks among equivalent programs. Imports `_tracing` and
`_runtime`."""
