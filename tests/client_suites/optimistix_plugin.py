"""A pytest plugin that runs optimistix's own tests with
`boundedloop.optimistix.CheckpointedAdjoint` as the adjoint of every solve.

optimistix 0.1.0's tests never name `RecursiveCheckpointAdjoint`: they differentiate
with `ImplicitAdjoint` (the default) and, for forward mode through the iterations,
with a test-local adjoint on `lax.while_loop`. This plugin replaces whichever adjoint
a solve is given, or its default, with ours, so that every solve runs on
`bl.while_loop` and every derivative the tests check goes through its iterations.

    PYTHONPATH=tests/client_suites python -m pytest -p optimistix_plugin \\
        PATH/TO/optimistix/tests/test_x.py

(`tests/client_suites/run.py optimistix` runs whole files this way, next to the same
tests with optimistix's own adjoints.) With `BOUNDEDLOOP_OPTIMISTIX_ADJOINT=lax` the
solves get `lax_unrolled_adjoint()` instead: the same iterations on
`lax.while_loop`, forward mode only, which tells whether a test that fails with ours
fails because it differentiates through the iterations or because of our loop.
"""

import functools
import os

import jax


def lax_unrolled_adjoint():
    """An `optx.AbstractAdjoint` that runs the solve's iterations on `lax.while_loop`,
    bounded by the solve's `max_steps`: exact forward mode (no reverse mode), the
    reference for differentiating through the iterations.

    **Returns:** an instance of it.
    """
    import optimistix as optx

    class LaxUnrolledAdjoint(optx.AbstractAdjoint):
        def apply(self, primal_fn, rewrite_fn, inputs, tags):
            del rewrite_fn, tags

            def loop(cond_fun, body_fun, init_val, *, max_steps, **_):
                def bounded_cond(carry):
                    step, val = carry
                    within = True if max_steps is None else step < max_steps
                    return within & cond_fun(val)

                def counted_body(carry):
                    step, val = carry
                    return step + 1, body_fun(val)

                return jax.lax.while_loop(bounded_cond, counted_body, (0, init_val))[1]

            return primal_fn(inputs + (loop,))

    return LaxUnrolledAdjoint()


def _with_our_adjoint(solve, adjoint):
    @functools.wraps(solve)
    def wrapped(*args, **kwargs):
        kwargs["adjoint"] = adjoint
        return solve(*args, **kwargs)

    return wrapped


def pytest_configure(config):
    # imported here, after optimistix's test configuration has installed jaxtyping's
    # import hook (which refuses packages imported before it)
    del config
    import optimistix

    from boundedloop.optimistix import CheckpointedAdjoint

    if os.environ.get("BOUNDEDLOOP_OPTIMISTIX_ADJOINT") == "lax":
        adjoint = lax_unrolled_adjoint()
    else:
        adjoint = CheckpointedAdjoint()
    for name in ["minimise", "least_squares", "root_find", "fixed_point"]:
        solve = getattr(optimistix, name)
        setattr(optimistix, name, _with_our_adjoint(solve, adjoint))
