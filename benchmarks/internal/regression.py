"""This tree against an earlier revision of boundedloop, side by side in one process:
gradient time (round-robin, shuffled, medians) and body evaluations per gradient on
the foundation workload (adaptive MLP, 8 steps taken), and gradient time on the
buffer workload of `buffers.py` (one row of an (M, 256) buffer written per step)
and on the neural ODE of `diffrax_adjoint.py` with `CheckpointedAdjoint()` and
`CheckpointedAdjoint(checkpoints=16)` (every step of its fill phase is a store).

    python benchmarks/internal/regression.py REV [--rounds 30] [--out FILE]

`REV` is checked out with `git worktree` into a temporary folder and imported under
another name, so both versions are compiled and timed in the same process. Internal:
it reaches past the public API to import a second revision of the package beside
this one; it publishes no figure (a change's commit message reports its ratios).
"""

import argparse
import importlib
import importlib.util
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import euler_step, EvalCounter, mlp, mlp_weights  # noqa: E402

import boundedloop as bl  # noqa: E402


TRIPS = 8


def import_revision(rev: str, where: pathlib.Path):
    """`boundedloop` as of `rev`, imported as the module `boundedloop_<rev>`."""
    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run(
        ["git", "-C", str(root), "worktree", "add", "--detach", str(where), rev],
        check=True,
        capture_output=True,
    )
    name = f"boundedloop_{rev.replace('-', '_').replace('~', '_')}"
    spec = importlib.util.spec_from_file_location(
        name,
        where / "boundedloop" / "__init__.py",
        submodule_search_locations=[str(where / "boundedloop")],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make(lib, max_steps, checkpoints, counter=None):
    def forward(w, x):
        def body(carry):
            x, step = carry
            if counter is not None:
                counter(step)
            return mlp(w, x), step + 1

        init = (x, jnp.array(0))
        out = lib.while_loop(
            lambda c: c[1] < TRIPS,
            body,
            init,
            max_steps=max_steps,
            checkpoints=checkpoints,
        )
        return jnp.sum(out[0])

    return forward


BUFFER_ROWS = (256, 4096)


def make_buffers(lib, rows, width=256, checkpoints=16):
    """`buffers.py`'s workload: the gradient of an M-step loop writing one row of an
    (M, width) buffer per step."""

    def loss(scale, v0):
        def body(carry):
            v, buf, i = carry
            v = jnp.tanh(v * scale + 0.01)
            return v, buf.at[i].set(v), i + 1

        out = lib.while_loop(
            lambda c: c[2] < rows,
            body,
            (v0, jnp.zeros((rows, width)), jnp.array(0)),
            max_steps=rows,
            checkpoints=checkpoints,
            buffers=lambda c: c[1],
        )
        return jnp.sum(out[1] ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


DIFFRAX_CHECKPOINTS = (None, 16)


def make_euler(lib, n=1000, width=32, checkpoints=16):
    """`cheap_steps.py`'s gradient: `n` Euler steps of `tanh(W x + b)`."""
    w = jax.random.normal(jax.random.key(0), (width, width)) / 6

    def loss(w, x0):
        final = lib.while_loop(
            lambda c: c[1] < n,
            euler_step(w, jnp.zeros(width)),
            (x0, jnp.array(0)),
            max_steps=n,
            checkpoints=checkpoints,
        )
        return jnp.sum(final[0] ** 2)

    return jax.jit(jax.grad(loss)), (w, jnp.ones(width))


def make_small_solve(lib):
    """`small_solves.py`'s gradient of a 100-step constant-step `Tsit5` solve of
    one number through `lib`'s adjoint."""
    import diffrax
    from small_solves import solve

    adjoints = importlib.import_module(lib.__name__ + ".diffrax")
    adjoint, solver = adjoints.CheckpointedAdjoint(), diffrax.Tsit5()

    def loss(y0, a):
        return jnp.sum(solve(y0, a, adjoint, solver, constant_steps=True) ** 2)

    return jax.jit(jax.grad(loss, argnums=1)), (jnp.ones(1), jnp.array([0.7, 0.3]))


# the speed tricks' workloads: label -> (max_steps, make)
TRICKS = {
    "cheap steps (Euler, width 32, 1000 steps)": (1000, make_euler),
    "in order (Tsit5, 1 number, 100 steps)": (4096, make_small_solve),
}


def make_diffrax(lib, checkpoints):
    """The gradient of `diffrax_adjoint.py`'s neural ODE through `lib`'s adjoint,
    and its arguments."""
    import diffrax_adjoint as workload
    import equinox as eqx

    adjoints = importlib.import_module(lib.__name__ + ".diffrax")
    kw = {} if checkpoints is None else {"checkpoints": checkpoints}
    adjoint = adjoints.CheckpointedAdjoint(**kw)
    field = workload.make_field()
    params, static = eqx.partition(field, eqx.is_inexact_array)
    y0 = jnp.linspace(-1.0, 1.0, workload.STATE)

    def loss(p):
        return workload.loss(eqx.combine(p, static), y0, adjoint)

    return jax.jit(jax.grad(loss)), (params,)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rev")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    weights, x = mlp_weights(), jnp.ones((1,))
    buffer_args = (jnp.array(1.1), jnp.linspace(-1.0, 1.0, 256))
    with tempfile.TemporaryDirectory() as tmp:
        where = pathlib.Path(tmp) / "old"
        old = import_revision(args.rev, where)
        try:
            libs = {"this tree": bl, args.rev: old}
            fns, fn_args, evals = {}, {}, {}
            for name, lib in libs.items():
                for max_steps in (8, 4096):
                    forward = make(lib, max_steps, args.checkpoints)
                    for arg in (0, 1):
                        key = (name, max_steps, "grad_w" if arg == 0 else "grad_x")
                        fns[key] = jax.jit(jax.grad(forward, argnums=arg))
                        jax.block_until_ready(fns[key](weights, x))
                    counter = EvalCounter()
                    counted = jax.jit(
                        jax.grad(make(lib, max_steps, args.checkpoints, counter), 1)
                    )
                    jax.block_until_ready(counted(weights, x))
                    counter.count = 0
                    jax.block_until_ready(counted(weights, x))
                    evals[(name, max_steps)] = counter.count
                for rows in BUFFER_ROWS:
                    fns[(name, rows, "buffers")] = make_buffers(lib, rows)
                    fn_args[(name, rows, "buffers")] = buffer_args
                for c in DIFFRAX_CHECKPOINTS:
                    key = (name, c, "diffrax")
                    fns[key], fn_args[key] = make_diffrax(lib, c)
                for label, (_, make_trick) in TRICKS.items():
                    key = (name, label, "trick")
                    fns[key], fn_args[key] = make_trick(lib)
                for key in fns:
                    jax.block_until_ready(fns[key](*fn_args.get(key, (weights, x))))
            samples = {k: [] for k in fns}
            order = list(fns)
            rng = random.Random(0)
            for _ in range(args.rounds):
                rng.shuffle(order)
                for k in order:
                    args_k = fn_args.get(k, (weights, x))
                    t0 = time.perf_counter()
                    jax.block_until_ready(fns[k](*args_k))
                    samples[k].append(time.perf_counter() - t0)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(where)],
                capture_output=True,
            )
    medians = {k: statistics.median(v) for k, v in samples.items()}
    rows = []
    print(
        f"| gradient | max_steps | this tree (ms) | {args.rev} (ms) | ratio | "
        "body evals (this / rev) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for max_steps in (8, 4096):
        for what in ("grad_x", "grad_w"):
            new = medians[("this tree", max_steps, what)]
            prev = medians[(args.rev, max_steps, what)]
            e_new, e_old = evals[("this tree", max_steps)], evals[(args.rev, max_steps)]
            rows.append(
                dict(
                    gradient=what,
                    max_steps=max_steps,
                    new_ms=1e3 * new,
                    old_ms=1e3 * prev,
                    ratio=new / prev,
                    evals_new=e_new,
                    evals_old=e_old,
                )
            )
            print(
                f"| {what} | {max_steps} | {1e3 * new:.3f} | {1e3 * prev:.3f} | "
                f"{new / prev:.3f} | {e_new} / {e_old} |"
            )

    def add_row(label, key, max_steps, name):
        new, prev = medians[("this tree", key, name)], medians[(args.rev, key, name)]
        rows.append(
            dict(
                gradient=label,
                max_steps=max_steps,
                new_ms=1e3 * new,
                old_ms=1e3 * prev,
                ratio=new / prev,
            )
        )
        print(
            f"| {label} | {max_steps} | {1e3 * new:.3f} | {1e3 * prev:.3f} | "
            f"{new / prev:.3f} | - |"
        )

    for m in BUFFER_ROWS:
        add_row("buffers (M rows)", m, m, "buffers")
    for c in DIFFRAX_CHECKPOINTS:
        label = "CheckpointedAdjoint()" if c is None else f"CheckpointedAdjoint({c})"
        add_row(f"diffrax neural, {label}", c, 4096, "diffrax")
    for label, (max_steps, _) in TRICKS.items():
        add_row(label, label, max_steps, "trick")
    if args.out:
        pathlib.Path(args.out).write_text(
            json.dumps({"rev": args.rev, "rounds": args.rounds, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
