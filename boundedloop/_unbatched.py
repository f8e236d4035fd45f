"""`any_across_batch`: a predicate that stays unbatched under `jax.vmap`.

`lax.while_loop` under `vmap` with a batched predicate selects every carry component
per element, so anything carried (the step counter, the checkpoint bookkeeping)
becomes batched too. Reducing the predicate over the batch first keeps the loop's
control unbatched; the loop body then masks finished elements itself.
"""

import jax.extend.core
import jax.numpy as jnp
from jax.interpreters import batching, mlir


def _impl(pred):
    return jnp.any(pred)


def _abstract_eval(pred):
    return jax.core.ShapedArray((), jnp.bool_)


def _batch(args, dims):
    (pred,), (dim,) = args, dims
    # reduce the batch axis away; what is left is one element's (scalar) predicate
    return any_across_batch_p.bind(jnp.any(pred, axis=dim)), None


any_across_batch_p = jax.extend.core.Primitive("boundedloop_any_across_batch")
any_across_batch_p.def_impl(_impl)
any_across_batch_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[any_across_batch_p] = _batch
mlir.register_lowering(
    any_across_batch_p, mlir.lower_fun(_impl, multiple_results=False)
)


def any_across_batch(pred):
    """`pred` (a scalar bool) unchanged; under `vmap`, true where any element's is."""
    return any_across_batch_p.bind(jnp.asarray(pred, dtype=bool))
