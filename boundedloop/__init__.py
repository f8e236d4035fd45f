"""boundedloop: bounded, checkpointed, reverse-mode differentiable loops for JAX."""

import importlib.metadata as _metadata

from equinox import (
    filter_grad as filter_grad,
    filter_jit as filter_jit,
    filter_value_and_grad as filter_value_and_grad,
    filter_vmap as filter_vmap,
)

from ._api._memory_plan import memory_plan as memory_plan, MemoryPlan as MemoryPlan
from ._api._module import Loop as Loop, LoopModule as LoopModule
from ._api._scan import fori_loop as fori_loop, scan as scan
from ._api._stats import LoopStats as LoopStats
from ._api._while_loop import while_loop as while_loop
from ._runtime._checks import (
    buffer_checks as buffer_checks,
    max_steps_check as max_steps_check,
)
from ._runtime._progress import progress_meter as progress_meter
from ._tracing._buffers import Buffer as Buffer


try:
    __version__ = _metadata.version("boundedloop")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"
