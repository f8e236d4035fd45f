"""The loop's derivatives. Imports `_sweeps`, `_tracing` and `_runtime`.

Undifferentiated, the loop (`_loop_jvp.differentiable_loop`) is `plain_sweep` and
does no checkpoint work. Its JVP rule binds one primitive, `loop_jvp_p`
(`_jvp_primitive.py`), that returns the outputs and their tangents, and that JAX
evaluates or splits as the transform requires. The rooms, by what a reader is looking for:

- `jax.jvp`, `jax.jacfwd` (forward mode): `loop_jvp_p`'s implementation evaluates
  `LoopJVP.one_pass` (`_loop_jvp.py`), the JVP of `plain_sweep`, one sweep with
  each step's value and tangent together.
- `jax.linearize`, and so `jax.grad`, `jax.vjp`, `jax.jacrev`: `loop_jvp_p`'s
  partial-evaluation rules (`_jvp_primitive.py`) run `LoopJVP.staged`
  (`checkpointed_sweep` now) and stage the tangent as one linear primitive,
  `loop_tangent_p` (`_tangent_primitive.py`). Applied, it is the JVP of `replay_sweep`
  (the same steps again from the initial carry); transposed, `reverse_sweep` over
  the checkpoints (`_reverse_sweep.py`).
- `jax.hessian`, `jvp` of `grad` (forward over reverse): forward mode through the
  checkpointed and reverse sweeps, which `lax.while_loop` supports.
- `grad` of `grad`, `grad` of `jvp`, penalties (reverse over anything):
  `_second_order.py`. The sweeps sit behind `_second_order.linearizable`: one
  pass when evaluated, and, when linearized, a `loop_tangent` whose transpose is a
  forward-over-reverse product, so no loop is ever reversed twice.
- `vmap` of any of these: `loop_jvp_p`'s and `loop_tangent_p`'s batching rules.

Tangents and cotangents exist for the initial carry and for every floating array the
body closes over (`body` is closure-converted, so those arrays are its leaves), and
only for those that are actually perturbed: JAX passes symbolic zeros for the rest, so
a weight matrix nobody differentiates costs nothing. Integer and boolean leaves get
none. Arrays the predicate closes over get none (it is piecewise constant).
"""
