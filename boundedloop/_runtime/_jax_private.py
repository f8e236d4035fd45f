"""Every JAX internal boundedloop relies on, and why; an upgrade of JAX touches this
file, and `tests/test_jax_private.py` checks each name on its own.

`jax._src` is not a public API: its names move between minor versions, which is why
`pyproject.toml` pins JAX below the next minor version of the one CI tests. Each name
below is needed because no public API does its job (as of JAX 0.10):

- **Primitive rules.** The loop's JVP is a primitive with its own partial-evaluation
  rules (`custom_partial_eval_rules` for `jax.linearize`'s tracer,
  `partial_eval_jaxpr_custom_rules` for staged jaxprs, as under `jax.checkpoint`) so
  that `jax.jvp` runs one pass and `jax.grad` two; and a batching rule that needs
  the axis data (`fancy_primitive_batchers`) to batch the primal's jaxpr. The
  partial-eval rule runs a pass in the tracer's context (`set_current_trace`),
  and the jaxpr rule hands JAX a `closed_call_p` of the pass it picks.
- **Jaxpr analyses.** Which carry leaves a perturbation reaches (`jvp_jaxpr` with
  symbolic zeros: its `instantiate=False` output reports per output whether the
  tangent is nonzero, without tracing the body again), which leaves the body never
  reads (`dce_jaxpr`), which outputs `vmap` batches (`batch_jaxpr`), all on the
  body's jaxpr with its constants as inputs (`convert_constvars_jaxpr`). Traced
  with `trace_to_jaxpr_dynamic` (`jax.make_jaxpr` would add a `pjit` around it).
- **Weak types.** `lax.while_loop` restores weak types of its results; no public
  function makes a weakly typed array (`_convert_element_type(weak_type=True)`).
- **Buffers are not values.** `pytype_aval_mappings` and the canonicalize
  handler make JAX raise our error when a `bl.Buffer` reaches a JAX operation.
- **Inputs found while tracing.** A body that reads a buffer takes, per read, an
  input standing in for the read's tangent (`_buffers._read`), whose shape only
  the read tells. The body is traced once all the same: each read adds that
  input to the jaxpr being built (`trace_ctx.trace`, `DynamicJaxprTrace.new_arg`,
  as `trace_to_jaxpr_dynamic` adds its arguments), and the closure conversion
  moves it to its place (`_closure.with_inputs_added`).
- **Sharding contexts.** The runtime checks raise on every device of a
  partitioned program; the lowering rule tells one from the axis context's type.
"""

import jax
import jax.extend.source_info_util
import numpy as np
from jax._src import (
    api_util,
    core as _core,
    dtypes as _dtypes,
    linear_util as _lu,
    sharding_impls as _sharding_impls,
)
from jax._src.interpreters import (
    ad as _ad,
    batching as _batching,
    partial_eval as _pe,
)
from jax._src.lax import lax as _lax


# primitive rules
custom_partial_eval_rules = _pe.custom_partial_eval_rules
partial_eval_jaxpr_custom_rules = _pe.partial_eval_jaxpr_custom_rules
fancy_primitive_batchers = _batching.fancy_primitive_batchers
set_current_trace = _core.set_current_trace
closed_call_p = _core.closed_call_p
Tracer = _core.Tracer
ClosedJaxpr = _core.ClosedJaxpr
mapped_aval = _core.mapped_aval

# jaxpr analyses
jvp_jaxpr = _ad.jvp_jaxpr
batch_jaxpr = _batching.batch_jaxpr
dce_jaxpr = _pe.dce_jaxpr
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr

# buffers are not values
pytype_aval_mappings = _core.pytype_aval_mappings
register_canonicalize_value_handler = _dtypes.register_canonicalize_value_handler

# sharding contexts
SPMDAxisContext = _sharding_impls.SPMDAxisContext
ShardingContext = _sharding_impls.ShardingContext


def register_batching(primitive, rule, *, axis_data: bool = False) -> None:
    """`rule` as `primitive`'s batching rule, where `vmap` reads it: every
    primitive of the package registers here. `axis_data`: the rule takes the axis
    data first (as `loop_jvp_p`'s, to batch the primal's jaxpr); otherwise it is a
    plain `(vals, dims, **params)` rule, which JAX's `primitive_batchers` (a shim
    JAX marks for deletion) wraps into that table."""
    if axis_data:
        fancy_primitive_batchers[primitive] = rule
    else:
        _batching.primitive_batchers[primitive] = rule


def closed_jaxpr(fn, avals, name: str) -> ClosedJaxpr:
    """The jaxpr of `fn(*args)` for arguments of types `avals`, constants closed
    over; `name` is what JAX's error messages call it."""
    debug = api_util.debug_info(name, fn, tuple(avals), {})
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
        _lu.wrap_init(fn, debug_info=debug), list(avals)
    )
    return ClosedJaxpr(jaxpr, consts)


def weakly_typed(x):
    """`x` as a weakly typed array of the same dtype."""
    return _lax._convert_element_type(x, np.dtype(x.dtype), weak_type=True)


def current_trace():
    """The trace JAX is tracing in now (`jax.make_jaxpr`'s, in a traced body)."""
    return _core.trace_ctx.trace


def new_input(trace, shape, dtype, like):
    """A new input of the jaxpr that `trace` (a `jax.make_jaxpr` trace) builds, added
    after its arguments: an array of `shape` and `dtype` that varies over the
    manual mesh axes `like` varies over (inside `shard_map`)."""
    like = jax.typeof(like)
    if like.manual_axis_type.empty:
        aval = _core.ShapedArray(shape, dtype)
    else:  # a type that varies needs its mesh: a replicated sharding on `like`'s
        sharding = jax.sharding.NamedSharding(
            like.sharding.mesh, jax.sharding.PartitionSpec()
        )
        aval = _core.ShapedArray(
            shape, dtype, sharding=sharding, manual_axis_type=like.manual_axis_type
        )
    return trace.new_arg(aval, jax.extend.source_info_util.current())
