"""Shared pieces of the benchmarks: the loops we compare, how we time and compile
them, and how we write results."""

import contextlib
import functools
import json
import pathlib
import platform
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax


def nested_scan_loop(cond_fun, body_fun, init, max_steps, base=2):
    """The common workaround: nested `lax.scan` + `lax.cond` up to `max_steps` (a
    power of `base`); its gradient costs `max_steps`."""
    depth = 0
    while base**depth < max_steps:
        depth += 1
    if base**depth != max_steps:
        raise ValueError("the nested scan loop needs max_steps to be a power of base")

    def run(level, val):
        if level == 0:
            return lax.cond(cond_fun(val), body_fun, lambda v: v, val)

        def step(v, _):
            return lax.cond(
                cond_fun(v), lambda v: run(level - 1, v), lambda v: v, v
            ), None

        return lax.scan(step, val, length=base)[0]

    return run(depth, init)


def fori_cond_loop(cond_fun, body_fun, init, max_steps):
    """`fori_loop` over `max_steps` with a `lax.cond` skipping finished steps."""
    return lax.fori_loop(
        0, max_steps, lambda _, v: lax.cond(cond_fun(v), body_fun, lambda v: v, v), init
    )


def timed(fn, *args) -> float:
    """Seconds of one call of `fn(*args)`, waiting for its result."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def median_time(fn, *args, reps: int = 7, min_time: float = 0.5):
    """Median wall time of `fn(*args)` (already compiled): at least `reps` runs and
    `min_time` seconds, fewer for calls slower than a second."""
    if timed(fn, *args) > 1.0:
        reps, min_time = 2, 0.0
    times = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_time:
        times.append(timed(fn, *args))
        if len(times) >= 200:
            break
    return statistics.median(times)


def interleaved(calls: dict, rounds: int, rng=None, shuffle=True) -> dict:
    """What each `calls[k]()` returns, a list per key: `rounds` rounds, each calling
    every one once, in an order shuffled by `rng` (by default `random.Random(0)`)."""
    rng = random.Random(0) if rng is None else rng
    samples, order = {k: [] for k in calls}, list(calls)
    for _ in range(rounds):
        if shuffle:
            rng.shuffle(order)
        for k in order:
            samples[k].append(calls[k]())
    return samples


def interleaved_medians(fns: dict, fn_args: dict, rounds: int, **how) -> dict:
    """Median seconds of each `fns[k](*fn_args[k])`, timed `interleaved(**how)`."""
    calls = {k: functools.partial(timed, fns[k], *fn_args[k]) for k in fns}
    samples = interleaved(calls, rounds, **how)
    return {k: statistics.median(v) for k, v in samples.items()}


def compile_time(fn, *args):
    """(trace + lower + compile seconds, compiled) of `jax.jit(fn)` for `args`."""
    trace_s, compile_s, compiled = compile_parts(fn, *args)
    return trace_s + compile_s, compiled


def compile_parts(fn, *args):
    """(trace + lower seconds, XLA compile seconds, compiled) of `jax.jit(fn)`."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return t1 - t0, time.perf_counter() - t1, compiled


def forget_compiles():
    """Forgets JAX's traces and compiles (diffrax's jitted `diffeqsolve` too) and
    boundedloop's caches, so that the next compile costs what a fresh process's would."""
    for module in [m for n, m in sys.modules.items() if n.startswith("boundedloop")]:
        for name in dir(module):
            cached = getattr(module, name)
            if callable(getattr(cached, "cache_clear", None)):
                cached.cache_clear()
    jax.clear_caches()


def cold_compile_parts(fn, *args):
    """`compile_parts`' two times after `forget_compiles()`."""
    forget_compiles()
    return compile_parts(fn, *args)[:2]


def temp_bytes(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


class EvalCounter:
    """Counts body evaluations through `jax.debug.callback`."""

    count = 0  # each instance's own from its first tick

    def __call__(self, value):
        # pass a loop-carried value so the callback cannot be hoisted out of a loop
        jax.debug.callback(self._tick, value)

    def _tick(self, value):
        self.count += 1


class WhileIterationCounter(EvalCounter):
    """Counts every `lax.while_loop` iteration of the programs traced inside `with
    counter:`, through a callback in each loop body (on a loop-carried operand)."""

    def __enter__(self):
        self._original = original = jax.lax.while_loop

        def counted(cond_fun, body_fun, init_val):
            def body(carry):
                self(jax.tree.leaves(carry)[0])
                return body_fun(carry)

            return original(cond_fun, body, init_val)

        jax.lax.while_loop = counted
        return self

    def __exit__(self, *exc):
        jax.lax.while_loop = self._original


def count_evals(make, args, control=False):
    """Body evaluations in one call of `jax.jit(make(counter))` (an `EvalCounter`),
    counted on a second call after a first that compiles; with `control`, also every
    `lax.while_loop` iteration (`WhileIterationCounter`), as `(evals, iterations)`."""
    counter, loops = EvalCounter(), WhileIterationCounter()
    with loops if control else contextlib.nullcontext():
        counted = jax.jit(make(counter))
        jax.block_until_ready(counted(*args))
    counter.count = loops.count = 0
    jax.block_until_ready(counted(*args))
    return (counter.count, loops.count) if control else counter.count


def max_abs_diff(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays."""
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def mlp_weights(width=1024, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    scale = 1.0 / jnp.sqrt(width)
    return (
        jax.random.normal(k1, (width, 1)),
        jax.random.normal(k2, (width, width)) * scale,
        jax.random.normal(k3, (1, width)) * scale,
    )


def mlp(weights, x):
    w1, w2, w3 = weights
    return w3 @ jnp.tanh(w2 @ jnp.tanh(w1 @ x))


EULER_DT = 0.01


def euler_step(w, b, counter=None):
    """`(x, i) -> (x + 0.01 tanh(W x + b), i + 1)`, calling `counter` if given."""

    def body(carry):
        x, i = carry
        if counter is not None:
            counter(i)
        return x + EULER_DT * jnp.tanh(w @ x + b), i + 1

    return body


def write_json(path, data):
    """`data` as JSON (indent 1) at `path`, its folder made if missing."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def write_results(path, **fields):
    """Write `fields`, with the machine and devices, as JSON to `path`."""
    machine = dict(machine=platform.platform(), devices=[str(d) for d in jax.devices()])
    write_json(path, {**machine, **fields})
