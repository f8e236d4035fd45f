"""This tree against an earlier revision of boundedloop, both imported in one process
(`REV` checked out by `git worktree`): gradient time (interleaved medians) of the
workloads of `while_loop.py` (with body evaluations), `buffers.py`, `cheap_steps.py`,
`small_solves.py` and `diffrax_adjoint.py`'s neural ODE. Publishes no figure: a
change's commit message reports its ratios.

    python benchmarks/internal/regression.py REV [--rounds 30] [--out FILE]
"""

import argparse
import importlib
import importlib.util
import pathlib
import sys


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/

import buffers  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import while_loop  # noqa: E402
from _common import (  # noqa: E402
    count_evals,
    euler_step,
    interleaved_medians,
    mlp_weights,
    write_json,
)
from same_programs import worktree  # noqa: E402

import boundedloop as bl  # noqa: E402


def import_revision(rev: str, where: pathlib.Path):
    """`boundedloop` as of `rev` (checked out at `where`) as `boundedloop_<rev>`."""
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
    """`while_loop.py`'s forward through `lib`'s loop."""
    return while_loop.make("boundedloop", max_steps, checkpoints, counter, lib)[0]


BUFFER_ROWS = (256, 4096)


def make_buffers(lib, rows):
    """`buffers.py`'s gradient with `buffers=`, through `lib`'s loop."""
    return jax.jit(buffers.make("boundedloop buffers", rows, lib))


DIFFRAX_CHECKPOINTS = (None, 16)


def make_euler(lib, n=1000, width=32, checkpoints=16):
    """`cheap_steps.py`'s gradient: `n` Euler steps of `tanh(W x + b)`."""
    w = jax.random.normal(jax.random.key(0), (width, width)) / 6

    def loss(w, x0):
        step, init = euler_step(w, jnp.zeros(width)), (x0, jnp.array(0))
        kw = dict(max_steps=n, checkpoints=checkpoints)
        return jnp.sum(lib.while_loop(lambda c: c[1] < n, step, init, **kw)[0] ** 2)

    return jax.jit(jax.grad(loss)), (w, jnp.ones(width))


def make_small_solve(lib):
    """`small_solves.py`'s 100-step `Tsit5` gradient, through `lib`'s adjoint."""
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
    """`diffrax_adjoint.py`'s neural ODE gradient through `lib`'s adjoint; args."""
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
    with worktree(args.rev) as where:
        old = import_revision(args.rev, where)
        fns, fn_args, evals = {}, {}, {}
        for name, lib in {"this tree": bl, args.rev: old}.items():
            for max_steps in (8, 4096):
                forward = make(lib, max_steps, args.checkpoints)
                for arg, what in enumerate(("grad_w", "grad_x")):
                    key = (name, max_steps, what)
                    fns[key] = jax.jit(jax.grad(forward, argnums=arg))
                    fn_args[key] = (weights, x)
                    jax.block_until_ready(fns[key](weights, x))
                evals[(name, max_steps)] = count_evals(
                    lambda c: jax.grad(make(lib, max_steps, args.checkpoints, c), 1),
                    (weights, x),
                )
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
                jax.block_until_ready(fns[key](*fn_args[key]))
        medians = interleaved_medians(fns, fn_args, args.rounds)
    print(
        f"| gradient | max_steps | this tree (ms) | {args.rev} (ms) | ratio | "
        "body evals (this / rev) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    compared = [  # (label, key, max_steps, kind, body evaluations counted)
        (what, m, m, what, True) for m in (8, 4096) for what in ("grad_x", "grad_w")
    ]
    compared += [("buffers (M rows)", m, m, "buffers", False) for m in BUFFER_ROWS]
    for c in DIFFRAX_CHECKPOINTS:
        label = "CheckpointedAdjoint()" if c is None else f"CheckpointedAdjoint({c})"
        compared.append((f"diffrax neural, {label}", c, 4096, "diffrax", False))
    for label, (max_steps, _) in TRICKS.items():
        compared.append((label, label, max_steps, "trick", False))
    rows = []
    for label, key, max_steps, kind, counted in compared:
        new, prev = medians[("this tree", key, kind)], medians[(args.rev, key, kind)]
        row = dict(gradient=label, max_steps=max_steps, new_ms=1e3 * new)
        row.update(old_ms=1e3 * prev, ratio=new / prev)
        said = "-"
        if counted:
            row.update(
                evals_new=evals[("this tree", key)], evals_old=evals[(args.rev, key)]
            )
            said = f"{row['evals_new']} / {row['evals_old']}"
        rows.append(row)
        print(
            f"| {label} | {max_steps} | {1e3 * new:.3f} | {1e3 * prev:.3f} | "
            f"{new / prev:.3f} | {said} |"
        )
    if args.out:
        write_json(args.out, {"rev": args.rev, "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
