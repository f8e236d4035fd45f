"""The opt-in progress meter: a tqdm bar fed from inside the compiled loop. The sweeps
call `tick` (`tick_reverse`) after each step and `done` after the loop; with the meter
off these are no-ops at trace time. What it shows: `docs/guides/scale.md`, "A
progress bar".
"""

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


# about this many updates over `max_steps` steps, unless `every` is given
UPDATES = 100
# with no bound on the steps, one update per this many steps
UNBOUNDED_EVERY = 1000


@dataclasses.dataclass(frozen=True)
class _Settings:
    every: int | None
    desc: str
    tqdm_class: Callable[..., Any]
    kwargs: dict


_settings: _Settings | None = None  # while the meter is on


def _import_tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(
            "`bl.progress_meter` needs tqdm, which is an optional dependency of "
            "boundedloop: install it with `pip install tqdm` (or, in a checkout of "
            "boundedloop, `pip install -e '.[progress]'`), or pass `tqdm_class=`."
        ) from None
    return tqdm


@contextlib.contextmanager
def progress_meter(
    every: int | None = None,
    *,
    desc: str = "boundedloop",
    tqdm_class: Callable[..., Any] | None = None,
    **tqdm_kwargs: Any,
):
    """Show a progress bar for the loops traced inside this block.

    Off by default and compiled out entirely when off. When on, the forward pass of
    every `bl.while_loop`, `bl.scan`, `bl.fori_loop` and `LoopModule.run` traced in
    the block reports its step count to a [tqdm](https://tqdm.github.io) bar through
    a host callback every `every` steps, and once more when it ends. A bar appears
    once a loop has taken `every` steps, so short loops stay quiet.

    The bar's total starts as `max_steps` (`None` for a loop with `max_steps=None`:
    tqdm then shows a count and a rate, not a percentage). When the loop ends the
    total becomes the steps actually taken, so a loop that stops early still ends at
    100%, reading e.g. `57/57`.

    Under a gradient (`jax.grad`, `jax.vjp`, ...) a second bar follows, labelled
    `desc + " (reverse)"`: its total is the steps the forward pass took, and it
    counts the steps reversed (each reversal includes its share of the
    checkpointing's recomputation, so it moves less evenly than the forward bar).
    Under `jax.vmap` there is one bar per loop, not one per element: it counts the
    batch's steps (those of its longest element).

    ```python
    with bl.progress_meter():
        out = jax.jit(f)(x)   # f calls bl.while_loop(..., max_steps=10**6)
        g = jax.jit(jax.grad(loss))(x)   # two bars: forward, then "(reverse)"
    ```

    Needs tqdm (`pip install tqdm`, or `pip install -e '.[progress]'` in a
    checkout) unless `tqdm_class` is given. The setting is read when the loop is
    traced and, unlike `bl.max_steps_check`'s, is not part of JAX's cache key: enter
    the block before the first call of a jitted function (a function traced inside
    it keeps its bar afterwards; `jax.clear_caches()` forgets it).

    **Arguments:**

    - `every`: steps between updates, a positive `int`. `None` picks
        `ceil(max_steps / 100)` (about 100 updates over the whole bound), or 1000 for
        a loop with `max_steps=None`. Each update is one host callback, which costs
        about as much as a small step: keep it well above 1 for cheap bodies.
    - `desc`: the bar's label (the reverse sweep's bar adds `" (reverse)"`).
    - `tqdm_class`: the bar to use, called as `tqdm_class(total=..., desc=...,
        **tqdm_kwargs)` and then used through `.n`, `.update(k)`, `.total` (set to
        the steps taken when the loop ends) and `.close()`. Default:
        `tqdm.auto.tqdm`.
    - `tqdm_kwargs`: passed on to `tqdm_class`, e.g. `leave=False`.
    """
    if every is not None and (
        isinstance(every, bool) or not isinstance(every, int) or every < 1
    ):
        raise ValueError(
            f"`bl.progress_meter` needs `every` to be a positive int or None, got "
            f"{every!r}."
        )
    if tqdm_class is None:
        tqdm_class = _import_tqdm()
    global _settings
    previous, _settings = _settings, _Settings(every, desc, tqdm_class, tqdm_kwargs)
    try:
        yield
    finally:
        _settings = previous


class Meter:
    """One traced loop's meter (one sweep's: a gradient's reverse sweep has its
    own). Its host methods run inside the callbacks, and open a bar per run of the
    compiled program."""

    def __init__(self, settings: _Settings, max_steps: int | None, reverse: bool):
        if settings.every is not None:
            self.every = settings.every
        elif max_steps is None:
            self.every = UNBOUNDED_EVERY
        else:
            self.every = max(1, math.ceil(max_steps / UPDATES))
        self.settings = settings
        # the forward bar's total until the loop ends; the reverse sweep's is
        # known only at run time (the steps taken), and comes with each callback
        self.total = None if reverse else max_steps
        self.desc = f"{settings.desc} (reverse)" if reverse else settings.desc
        self.bar = None

    def _update(self, steps, total=None):
        steps = int(steps)
        if self.bar is None:
            total = self.total if total is None else int(total)
            s = self.settings
            self.bar = s.tqdm_class(total=total, desc=self.desc, **s.kwargs)
        if steps > self.bar.n:
            self.bar.update(steps - self.bar.n)

    def _close(self, steps):
        if self.bar is not None:  # a loop shorter than `every` steps shows nothing
            # the steps taken become the total, so the bar ends full (tqdm draws
            # the closed bar with it)
            self.bar.total = int(steps)
            self._update(steps)
            self.bar.close()
            self.bar = None


def start(max_steps: int | None, reverse: bool = False) -> Meter | None:
    """At trace time: the meter for a loop bounded by `max_steps` (for its reverse
    sweep, `reverse`), or `None` (off)."""
    return None if _settings is None else Meter(_settings, max_steps, reverse)


@jax.custom_batching.custom_vmap
def _shared(steps):
    return steps


@_shared.def_vmap
def _shared_vmap(axis_size, in_batched, steps):
    # the loop's iteration count: every element that is still going has this many
    del axis_size, in_batched
    return jnp.max(steps), False


def _count(steps):
    """`steps` as the batch's one int32 count."""
    return _shared(jnp.asarray(steps, jnp.int32))


def tick(meter: Meter | None, steps):
    """Inside the loop, after a step: report `steps` (steps taken) every `every`."""
    if meter is None:
        return
    steps = _count(steps)
    lax.cond(
        steps % meter.every == 0,
        lambda: jax.debug.callback(meter._update, steps),
        lambda: None,
    )


def tick_reverse(meter: Meter | None, before, steps, total):
    """Inside the reverse sweep, after an iteration that took the count of steps
    reversed from `before` to `steps` (one step or several): report `steps` if it
    passed a multiple of `every`. `total`: the steps the forward pass took."""
    if meter is None:
        return
    before, steps, total = _count(before), _count(steps), _count(total)
    lax.cond(
        steps // meter.every > before // meter.every,
        lambda: jax.debug.callback(meter._update, steps, total),
        lambda: None,
    )


def done(meter: Meter | None, steps):
    """After the loop: the final count, which becomes the bar's total, and close
    the bar."""
    if meter is not None:
        jax.debug.callback(meter._close, _count(steps))
