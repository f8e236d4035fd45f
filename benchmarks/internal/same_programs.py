"""Does a change alter what reaches XLA? The lowered `programs` of our loops, in this
tree and at a revision (a worktree, in a process of its own), compared by hash: where
all are the same, a result measured at `REV` on a device holds for this tree. With
`--off-cpu`, the cost model's backend-dependent choices are made as on a TPU.
Internal: it reaches inside the package's cost model.

    python benchmarks/internal/same_programs.py REV [--off-cpu]
        [--out benchmarks/results/same_programs.txt (same_programs_off_cpu.txt)]
"""

import argparse
import contextlib
import functools
import hashlib
import inspect
import os
import pathlib
import subprocess
import sys
import tempfile


ROOT = pathlib.Path(__file__).resolve().parents[2]


def git(*args, check=False) -> str:
    """`git -C ROOT *args`'s output."""
    command = ["git", "-C", str(ROOT), *args]
    run = subprocess.run(command, capture_output=True, text=True, check=check)
    return run.stdout.strip()


@contextlib.contextmanager
def worktree(rev: str):
    """A git worktree of `rev` in a temporary folder, removed on leaving."""
    with tempfile.TemporaryDirectory() as where:
        tree = pathlib.Path(where) / "tree"
        git("worktree", "add", "--detach", str(tree), rev, check=True)
        try:
            yield tree
        finally:
            git("worktree", "remove", "--force", str(tree))


def programs() -> dict:
    """Name: the lowered program, for the `boundedloop` this process imports."""
    import diffrax
    import jax
    import jax.numpy as jnp
    import optimistix as optx

    import boundedloop as bl
    from boundedloop.diffrax import CheckpointedAdjoint

    try:
        from boundedloop._sweeps import _cost_model
    except ImportError:  # a tree from before the layers' subpackages (0c4fd6b)
        from boundedloop import _cost_model

    if os.environ.get("SAME_PROGRAMS_OFF_CPU"):  # decide as on a TPU
        _cost_model.runs_in_order = lambda *args: False
        # `is_cheap` took a `backend` in some trees, `shares_one_step` from 47953b9
        for name in ("is_cheap", "shares_one_step", "lists_splits"):
            fn = getattr(_cost_model, name, None)
            if fn and "backend" in inspect.signature(fn).parameters:
                setattr(_cost_model, name, functools.partial(fn, backend="tpu"))
    from boundedloop.optimistix import CheckpointedAdjoint as SolveAdjoint

    w = jnp.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]])
    x = jnp.array([0.1, -0.2, 0.3])

    def loop(x, w, checkpoints, buffers):
        def body(carry):
            x, i, rows = carry
            before = jnp.where(i > 0, rows[jnp.maximum(i - 1, 0)], x)
            x = jnp.tanh(w @ x + 0.1 * before)
            return x, i + 1, rows.at[i].set(x)

        out = bl.while_loop(
            lambda c: c[1] < 7 + (x[0] > 5),
            body,
            (x, jnp.array(0), jnp.zeros((12, 3))),
            max_steps=12,
            checkpoints=checkpoints,
            buffers=(lambda c: c[2]) if buffers else None,
        )
        return jnp.sum(out[0] ** 2) + jnp.sum(out[2])

    found = {}
    for checkpoints in (1, 3, None):
        for buffers in (False, True):

            def f(x, w, checkpoints=checkpoints, buffers=buffers):
                return loop(x, w, checkpoints, buffers)

            tag = f"checkpoints={checkpoints} buffers={buffers}"
            found[f"primal {tag}"] = jax.jit(f).lower(x, w)
            found[f"grad {tag}"] = jax.jit(jax.grad(f, (0, 1))).lower(x, w)
            jvp = jax.jit(lambda x, w, f=f: jax.jvp(f, (x, w), (x, w)))
            found[f"jvp {tag}"] = jvp.lower(x, w)
            found[f"hessian {tag}"] = jax.jit(jax.hessian(f)).lower(x, w)
            batched = jax.jit(jax.vmap(jax.grad(f), (0, None)))
            found[f"vmap grad {tag}"] = batched.lower(jnp.stack([x, -x]), w)

    def nested(w):
        def outer(carry):
            y, j = carry
            inner = bl.while_loop(
                lambda c: c[1] < j + 2,
                lambda c: (jnp.tanh(w @ c[0]), c[1] + 1),
                (y, jnp.array(0)),
                max_steps=6,
            )
            return inner[0], j + 1

        out = bl.while_loop(lambda c: c[1] < 3, outer, (x, jnp.array(0)), max_steps=4)
        return jnp.sum(out[0])

    found["grad nested"] = jax.jit(jax.grad(nested)).lower(w)

    def scanned(w):
        return jnp.sum(bl.scan(lambda c, _: (jnp.tanh(w @ c), c), x, None, 5)[1])

    found["grad scan"] = jax.jit(jax.grad(scanned)).lower(w)

    def solve(a):
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, a: -a * y),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.ones(2),
            args=a,
            adjoint=CheckpointedAdjoint(),
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-4),
        )
        return jnp.sum(solution.ys)

    found["diffrax grad"] = jax.jit(jax.grad(solve)).lower(0.7)

    def minimum(a):
        solution = optx.minimise(
            lambda y, a: jnp.sum((y - a) ** 2 + 0.1 * y**4),
            optx.BFGS(rtol=1e-6, atol=1e-6),
            jnp.zeros(2),
            args=a,
            max_steps=32,
            throw=False,
            adjoint=SolveAdjoint(),
        )
        return jnp.sum(solution.value)

    found["optimistix hessian"] = jax.jit(jax.hessian(minimum)).lower(0.5)
    return found


def hashes(path: pathlib.Path, off_cpu: bool) -> dict:
    """Each program's hash and line count, from a process importing the tree `path`."""
    env = dict(os.environ, PYTHONPATH=str(path), JAX_PLATFORMS="cpu")
    if off_cpu:
        env["SAME_PROGRAMS_OFF_CPU"] = "1"
    how = dict(env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    child = subprocess.run([sys.executable, __file__, "--print"], **how, check=True)
    return dict(line.split(" ", 1)[::-1] for line in child.stdout.splitlines())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?")
    parser.add_argument("--print", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--off-cpu", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    suffix = "_off_cpu" if args.off_cpu else ""
    out = args.out or ROOT / f"benchmarks/results/same_programs{suffix}.txt"
    if args.print:
        for name, lowered in programs().items():
            text = lowered.as_text()
            digest = hashlib.sha1(text.encode()).hexdigest()[:12]
            print(f"{digest}:{len(text.splitlines())} {name}")
        return
    with worktree(args.rev) as tree:
        theirs = hashes(tree, args.off_cpu)
    ours = hashes(ROOT, args.off_cpu)
    head = git("rev-parse", "--short", "HEAD")
    how = " as off a CPU" if args.off_cpu else ""
    lines = [
        f"# lowered programs{how}, this tree ({head}, with its uncommitted changes) "
        f"against {args.rev}"
    ]
    differ = 0
    for name in ours:
        same = ours[name] == theirs.get(name)
        differ += not same
        lines.append(f"{'same   ' if same else 'DIFFER '} {ours[name]:>20s} {name}")
    lines.append(f"{differ} of {len(ours)} differ")
    print("\n".join(lines))
    pathlib.Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
