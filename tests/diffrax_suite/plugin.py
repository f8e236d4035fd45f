"""A pytest plugin that runs diffrax's own tests with `CheckpointedAdjoint` as the
default adjoint of `diffrax.diffeqsolve` (tests that pass an adjoint keep it). With
`BOUNDEDLOOP_REPLACE_RCA=1` in the environment, tests that name
`diffrax.RecursiveCheckpointAdjoint` get `CheckpointedAdjoint` too.

    python -m pytest -p tests.diffrax_suite.plugin PATH/TO/diffrax/test/test_x.py

(`tests/diffrax_suite/run.py` runs whole files this way, one test per process, next
to the same tests with diffrax's default adjoint.)
"""

import functools
import os

import diffrax

from boundedloop.diffrax import CheckpointedAdjoint


_NOT_GIVEN = object()


def _with_our_default(diffeqsolve):
    @functools.wraps(diffeqsolve)
    def wrapped(*args, adjoint=_NOT_GIVEN, **kwargs):
        if adjoint is _NOT_GIVEN:
            adjoint = CheckpointedAdjoint()
        return diffeqsolve(*args, adjoint=adjoint, **kwargs)

    return wrapped


def pytest_configure(config):
    del config
    diffrax.diffeqsolve = _with_our_default(diffrax.diffeqsolve)
    if os.environ.get("BOUNDEDLOOP_REPLACE_RCA") == "1":
        # only the name tests use: diffrax's own modules keep the real class
        diffrax.RecursiveCheckpointAdjoint = CheckpointedAdjoint
