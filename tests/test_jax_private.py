"""Each JAX internal that `boundedloop/_jax_private.py` names, used on its own as the
package uses it. Run this file first after upgrading JAX: a name that moved fails
here with the mechanism it serves, before the loops that rely on it fail in ways
that hide why."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boundedloop._autodiff._jvp_primitive import loop_jvp_p
from boundedloop._autodiff._tangent_primitive import loop_tangent_p
from boundedloop._runtime import _jax_private as private
from boundedloop._tracing._closure import closure_convert, with_inputs_added


F32 = jax.core.ShapedArray((3,), jnp.float32)


def test_an_input_found_while_tracing_joins_the_jaxpr():
    """The single trace of a body that reads buffers: `new_input` adds an input to
    the jaxpr being traced, after its arguments, and `with_inputs_added` moves it
    to its place among them."""

    def f(x, y):
        found = private.new_input(private.current_trace(), (3,), jnp.float32, x)
        return x * found + y

    x, y = jnp.arange(3.0), jnp.ones(3)
    traced = with_inputs_added(closure_convert(f, x, y), 1, x, 2 * y, y)
    # the found input now comes second: f(x, y) with `found = 2 y`
    np.testing.assert_allclose(traced(x, 2 * y, y), x * 2 * y + y)


def test_jaxpr_analyses_answer_per_input_and_output():
    """`closed_jaxpr` traces with constants closed over; `jvp_jaxpr` with symbolic
    zeros says which outputs a perturbation reaches, `batch_jaxpr` which outputs
    `vmap` batches, `dce_jaxpr` which inputs are used."""
    w = jnp.array([1.0, 2.0, 3.0])
    jaxpr = private.closed_jaxpr(lambda a, b: (a * w, b + 1.0), [F32, F32], "test")
    assert len(jaxpr.consts) == 1
    _, nonzero = private.jvp_jaxpr(jaxpr, [True, False], instantiate=False)
    assert list(nonzero) == [True, False]
    _, batched = private.batch_jaxpr(
        jaxpr, _axis_data(4), [False, True], instantiate=False
    )
    assert list(batched) == [False, True]
    opened = private.convert_constvars_jaxpr(jaxpr.jaxpr)
    _, used = private.dce_jaxpr(opened, [True, False])
    assert used == [True, True, False]  # the constant and `a`, not `b`


def _axis_data(size):
    """What JAX hands a batching rule (`fancy_primitive_batchers`) for an axis."""
    from jax._src.interpreters.batching import AxisData

    return AxisData(None, size, None, None)


def test_a_weakly_typed_array_can_be_made():
    x = private.weakly_typed(jnp.float32(2.0))
    assert jax.typeof(x).weak_type and x.dtype == jnp.float32


def test_the_primitives_rules_are_registered_where_jax_reads_them():
    """The loop's JVP runs one pass or two by its partial-evaluation rules, and
    batches with the axis data; JAX must find each rule where it is registered
    (`register_batching` writes both tables)."""
    assert loop_jvp_p in private.custom_partial_eval_rules
    assert loop_jvp_p in private.partial_eval_jaxpr_custom_rules
    assert loop_jvp_p in private.fancy_primitive_batchers
    assert private.closed_call_p in private.partial_eval_jaxpr_custom_rules
    assert loop_tangent_p.name == "boundedloop_loop_tangent"
    # the plain rules (`register_batching` without `axis_data`) land there too
    assert loop_tangent_p in private.fancy_primitive_batchers


def test_a_buffer_reaching_a_jax_operation_raises_our_error():
    """`pytype_aval_mappings` makes JAX call us for a `Buffer` it meets."""
    import boundedloop as bl

    def body(carry):
        x, buf = carry
        return x + jnp.sum(buf), buf  # `buf` is a Buffer, not an array

    with pytest.raises(
        ValueError, match="A `bl.Buffer` .* was passed to a JAX operation"
    ):
        bl.while_loop(
            lambda c: c[0] < 3,
            body,
            (0.0, jnp.zeros(2)),
            max_steps=4,
            buffers=lambda c: c[1],
        )


def test_higher_order_primitives_hold_the_jaxprs_we_retype():
    """`_closure.RETYPE` rebuilds these primitives' jaxpr parameters, by these names,
    when the loop replays a body inside `shard_map` (`test_shard_map_body_runs`)."""
    from boundedloop._tracing._closure import RETYPE

    w = jnp.ones((3, 3))

    def f(x):
        x = jax.lax.scan(lambda c, _: (w @ c, None), x, length=2)[0]
        x = jax.lax.while_loop(lambda c: c[0] < 0, lambda c: c, x)
        x = jax.lax.cond(x[0] > 0, lambda x: x, jnp.sin, x)
        return jax.checkpoint(jnp.tanh)(x)

    f_jvp = jax.custom_jvp(f)
    f_jvp.defjvp(lambda p, t: (f(*p), t[0]))
    eqns = jax.make_jaxpr(f_jvp)(jnp.ones(3)).jaxpr.eqns
    eqns += jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns
    names = {e.primitive.name: set(e.params) for e in eqns}
    assert set(RETYPE) <= set(names)
    needed = {
        "custom_jvp_call": {"call_jaxpr", "jvp_jaxpr_fun", "num_consts"},
        "scan": {"jaxpr", "num_consts", "num_carry"},
        "while": {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"},
        "cond": {"branches"},
        "remat2": {"jaxpr"},
    }
    for name, params in needed.items():
        assert params <= names[name], name
