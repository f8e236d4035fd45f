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
tests with optimistix's own adjoints.)
"""

import functools


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

    for name in ["minimise", "least_squares", "root_find", "fixed_point"]:
        solve = getattr(optimistix, name)
        setattr(optimistix, name, _with_our_adjoint(solve, CheckpointedAdjoint()))
