"""A pytest plugin that runs diffrax's own tests with `CheckpointedAdjoint` as the
default adjoint of `diffrax.diffeqsolve` (tests that pass an adjoint keep it). With
`BOUNDEDLOOP_REPLACE_RCA=1` in the environment, tests that name
`diffrax.RecursiveCheckpointAdjoint` get `CheckpointedAdjoint` too.

    python -m pytest -p tests.client_suites.diffrax_plugin PATH/TO/diffrax/test/test_x.py

(`tests/client_suites/run.py diffrax` runs whole files this way, one test per
process, next to the same tests with diffrax's default adjoint.)
"""

import functools
import os


_NOT_GIVEN = object()


def _with_our_default(diffeqsolve, adjoint_class):
    @functools.wraps(diffeqsolve)
    def wrapped(*args, adjoint=_NOT_GIVEN, **kwargs):
        if adjoint is _NOT_GIVEN:
            adjoint = adjoint_class()
        return diffeqsolve(*args, adjoint=adjoint, **kwargs)

    return wrapped


def pytest_configure(config):
    # imported here, after diffrax's test configuration has installed jaxtyping's
    # import hook (which refuses packages imported before it)
    del config
    import diffrax

    from boundedloop.diffrax import CheckpointedAdjoint

    diffrax.diffeqsolve = _with_our_default(diffrax.diffeqsolve, CheckpointedAdjoint)
    if os.environ.get("BOUNDEDLOOP_REPLACE_RCA") == "1":
        # only the name tests use: diffrax's own modules keep the real class
        diffrax.RecursiveCheckpointAdjoint = CheckpointedAdjoint
