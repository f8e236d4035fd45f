"""Memory: a gradient with a fixed number of checkpoints has compiled temporary memory
independent of `max_steps`, and a long loop's gradient runs to completion."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
from jax import lax

import boundedloop as bl


SCRIPTS = pathlib.Path(__file__).parent / "scripts"
_spec = importlib.util.spec_from_file_location(
    "long_gradient", SCRIPTS / "long_gradient.py"
)
long_gradient = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(long_gradient)

X = jnp.array([0.3, -0.2, 0.5, 0.1])
W = jnp.array([1.0, 2.0, -1.0, 0.5])


def temp_bytes(max_steps, checkpoints):
    def loss(x, w, n):
        final = bl.while_loop(
            lambda c: c[1] < n,
            long_gradient.body(w),
            (x, jnp.array(0)),
            max_steps=max_steps,
            checkpoints=checkpoints,
        )
        return long_gradient.loss(final[0])

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    compiled = grad.lower(X, W, jnp.array(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temp_memory_does_not_depend_on_max_steps():
    """Compiled temporary memory at 16 checkpoints is the same, within the store
    rule's small arrays, from `max_steps=64` to `10**6` and unbounded; what a tape
    would take grows with the steps."""
    table, online = [64, 1000], [100_000, 10**6, None]
    sizes = {m: temp_bytes(m, 16) for m in table + online}
    # Bounds up to `TABLE_STEPS` replay a table of stores (a constant); longer ones,
    # and no bound, carry the store rule's state instead: small int32 arrays of at
    # most one entry per slot, whatever the steps. Within each kind the size is one
    # (up to layout: a TPU v5e gave 64 and 1000 steps sizes 32 KiB apart) ...
    for kind in (table, online):
        spread = max(sizes[m] for m in kind) - min(sizes[m] for m in kind)
        assert spread <= 64 * 1024, sizes
    # ... and the rule's state, with the split computed in the program (a bounded
    # loop's are listed), costs a layout's worth of small arrays: 1.2 KiB on a CPU,
    # 283 KiB on a TPU v5e, which pads each small array to a 4 KiB tile (71 tiles).
    # At most 80 tiles, where a tape would take 16 bytes a step.
    assert abs(sizes[None] - sizes[64]) <= 80 * 4096, sizes

    # it is the checkpoints that cost memory: 240 more cost at least 200 rows. Rows of
    # 4 MiB (only lowered, never allocated): a TPU v5e keeps loop buffers that fit in
    # its on-chip memory (layout `S(1)`), which `temp_size_in_bytes` does not count;
    # it put a 4096-number carry's 256 checkpoints there (646 KiB at 16, 614 KiB at 256)
    row_numbers = 2**20

    def wide_temp_bytes(checkpoints):
        def loss(x, n):
            final = bl.while_loop(
                lambda c: c[1] < n,
                lambda c: (jnp.tanh(c[0]) * 1.01, c[1] + 1),
                (x, jnp.array(0)),
                max_steps=1000,
                checkpoints=checkpoints,
            )
            return jnp.sum(final[0])

        x = jax.ShapeDtypeStruct((row_numbers,), jnp.float32)
        grad = jax.jit(jax.grad(loss)).lower(x, jnp.array(0)).compile()
        return grad.memory_analysis().temp_size_in_bytes

    assert wide_temp_bytes(256) - wide_temp_bytes(16) >= 200 * row_numbers * 4

    # ... and far less than a scan that keeps every step's residuals: one carry (16
    # bytes at least) per step, 16 MB at 10**6 steps
    def scan_loss(x, w):
        final, _ = lax.scan(
            lambda c, _: (long_gradient.body(w)(c), None),
            (x, jnp.array(0)),
            length=10**6,
        )
        return long_gradient.loss(final[0])

    scan = jax.jit(jax.grad(scan_loss, argnums=(0, 1))).lower(X, W).compile()
    scan_bytes = scan.memory_analysis().temp_size_in_bytes
    assert scan_bytes >= 10**6 * 16
    assert max(sizes.values()) * 10 < scan_bytes, (sizes, scan_bytes)


def test_long_gradient_in_a_loop_bounded_far_beyond():
    """16000 steps in a program bounded at 10**6 steps: finite, equal to
    `lax.scan`'s gradient."""
    long_gradient.run(16_000, 10**6)  # checks finiteness and the reference itself


def test_100000_step_gradient():
    """100000 steps bounded at 100000: finite, equal to `lax.scan`'s gradient. No
    wall-clock limit here (a busy machine would make it flaky): the cost is checked
    structurally, by `test_structure.py` (the loop's body evaluations follow the
    schedule, with the table and with the in-loop rule) and `test_schedule.py` (the
    schedule's evaluations near the optimum up to 3 * 10**5 steps); the time is
    measured in docs/design-notes.md (long loops)."""
    long_gradient.run(100_000, 100_000)


def test_a_leaf_the_loop_never_changes_is_stored_once():
    """A carry leaf the body returns as it took it (here 4096 parameters carried
    along and read by every step) is kept once, not once per checkpoint: the
    gradient's compiled temporary memory is below two copies of it, where a row
    per checkpoint would take 40 (every step of `max_steps=40`). Its gradient, and its second derivative (forward over reverse),
    are those of `lax.scan` over the steps taken, at every checkpoint count."""

    def loss(x, p, n, checkpoints):
        def body(c):
            x, p, i = c
            return jnp.tanh(x * jnp.mean(p) + 0.1), p, i + 1

        init = (x, p, jnp.array(0))
        out = bl.while_loop(
            lambda c: c[2] < n, body, init, max_steps=40, checkpoints=checkpoints
        )
        return jnp.sum(out[0] ** 2)

    def scan_loss(x, p, n):
        final, _ = lax.scan(
            lambda x, _: (jnp.tanh(x * jnp.mean(p) + 0.1), None), x, length=n
        )
        return jnp.sum(final**2)

    p = jnp.linspace(-1.0, 1.0, 4096)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
    compiled = grad.lower(X, p, 0, 64).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * p.nbytes
    small = p[:3]
    for checkpoints in [1, 3, 64]:
        for n in [0, 1, 17, 40]:
            want = jax.grad(scan_loss, argnums=(0, 1))(X, small, n)
            got = grad(X, small, n, checkpoints)
            # float32, summed in other orders: entries near zero differ in ulps of
            # the larger ones
            close = [jnp.allclose(a, b, atol=1e-6) for a, b in zip(got, want)]
            assert all(close), (checkpoints, n)
    hessian = jax.hessian(loss, argnums=1)(X, small, 17, 3)
    want = jax.hessian(scan_loss, argnums=1)(X, small, 17)
    assert jnp.allclose(hessian, want, atol=1e-6)


def test_the_default_count_is_the_documented_one():
    """`checkpoints=None` is every step up to `max_steps=16`, then
    `2 * (ceil(log2(max_steps)) + 4)` copies (at most `max_steps`), and 32 with no
    bound: the gradient makes the body evaluations and holds the temporary memory
    of that count given explicitly."""
    from boundedloop._sweeps._schedule import default_checkpoints

    expected = {1: 1, 16: 16, 17: 17, 18: 18, 20: 18, 1024: 28, 4096: 32, None: 32}
    assert {m: default_checkpoints(m) for m in expected} == expected
    calls = []

    def loss(x, n, checkpoints):
        def body(c):
            jax.debug.callback(lambda: calls.append(1))
            return jnp.sin(c[0]) + 0.5, c[1] + 1

        final = bl.while_loop(
            lambda c: c[1] < n, body, (x, 0), max_steps=64, checkpoints=checkpoints
        )
        return jnp.sum(final[0])

    found = {}
    for checkpoints in [None, 20, 10]:
        grad = jax.jit(jax.grad(loss), static_argnums=2)
        compiled = grad.lower(X, 60, checkpoints).compile()
        calls.clear()
        jax.block_until_ready(grad(X, 60, checkpoints))
        found[checkpoints] = (len(calls), compiled.memory_analysis().temp_size_in_bytes)
    assert found[None] == found[20], found  # 2 * (6 + 4) at `max_steps=64`
    assert found[10][0] > found[20][0], found  # fewer copies: more recomputation
