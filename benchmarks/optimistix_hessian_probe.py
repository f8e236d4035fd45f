"""Which second derivatives of an optimistix solve compile on this backend, each in a
process of its own (on a TPU v5e, XLA's compiler aborted the process on the
optimistix guide's `jax.hessian`; see the limitations page).

    python benchmarks/optimistix_hessian_probe.py [--only NAME ...] [--xla-flags FLAGS]
        [--out benchmarks/results/optimistix_hessian_probe_<platform>.json]

The problem is the guide's: the Rosenbrock-like valley in 3 variables, BFGS at rtol =
atol = 1e-6 from (-1, 1.5, 0.5), `max_steps=64`, `throw=False`, the loss the sum of
the solution, differentiated with respect to the scalar `a = 1`. Each case (below)
runs in a fresh Python process, so an abort ends that case only: its row records the
exit status and the compiler's failed check if it printed one. A row with a value
also has the value on the host CPU backend, computed in the same process. With
`--xla-flags`, every case runs again with `XLA_FLAGS` set to them. A TPU's own
compiler flags (`xla_tpu_*`, `xla_msa_*`) go in `LIBTPU_INIT_ARGS` instead, set
around the call; each row records both variables.
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys


# name: (solver, adjoint, checkpoints, transform)
CASES = {
    "guide hessian": ("BFGS", "ours", None, "hessian"),
    "guide hessian, 1 checkpoint": ("BFGS", "ours", 1, "hessian"),
    "guide hessian, 8 checkpoints": ("BFGS", "ours", 8, "hessian"),
    "guide hessian, 64 checkpoints": ("BFGS", "ours", 64, "hessian"),
    "guide jacfwd of jacfwd": ("BFGS", "ours", None, "jacfwd_jacfwd"),
    "guide grad": ("BFGS", "ours", None, "grad"),
    "guide jacfwd": ("BFGS", "ours", None, "jacfwd"),
    "guide hessian, RecursiveCheckpointAdjoint": ("BFGS", "rca", None, "hessian"),
    "nonlinear CG hessian": ("NonlinearCG", "ours", None, "hessian"),
    "gradient descent hessian": ("GradientDescent", "ours", None, "hessian"),
}


def run_case(name: str) -> dict:
    """In this process: the case's value, jitted, on the default backend and the host."""
    import jax
    import jax.numpy as jnp
    import optimistix as optx

    from boundedloop.optimistix import CheckpointedAdjoint

    solver_name, adjoint_name, checkpoints, transform = CASES[name]
    options = {"learning_rate": 0.05} if solver_name == "GradientDescent" else {}
    solver = getattr(optx, solver_name)(rtol=1e-6, atol=1e-6, **options)
    if adjoint_name == "ours":
        adjoint = CheckpointedAdjoint(checkpoints=checkpoints)
    else:
        adjoint = optx.RecursiveCheckpointAdjoint(checkpoints=checkpoints)

    def valley(y, a):
        terms = a * (y[1:] - y[:-1] ** 2) ** 2 + (1 - y[:-1]) ** 2
        return jnp.sum(terms) + 0.1 * a * y[0]

    def solution_sum(a):
        y0 = jnp.array([-1.0, 1.5, 0.5])
        solution = optx.minimise(
            valley, solver, y0, args=a, max_steps=64, throw=False, adjoint=adjoint
        )
        return jnp.sum(solution.value)

    f = {
        "hessian": jax.hessian(solution_sum),
        "jacfwd_jacfwd": jax.jacfwd(jax.jacfwd(solution_sum)),
        "grad": jax.grad(solution_sum),
        "jacfwd": jax.jacfwd(solution_sum),
    }[transform]
    value = float(jax.jit(f)(jnp.array(1.0)))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        host = float(jax.jit(f)(jax.device_put(jnp.array(1.0), cpu)))
    return {"value": value, "host": host, "backend": jax.default_backend()}


def probe(name: str, xla_flags: str) -> dict:
    """Runs one case in a child process; its row."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    child = subprocess.run(
        [sys.executable, __file__, "--case", name],
        capture_output=True,
        env=env,
        text=True,
    )
    row = {
        "case": name,
        "xla_flags": env.get("XLA_FLAGS", ""),
        "libtpu_init_args": env.get("LIBTPU_INIT_ARGS", ""),
        "returncode": child.returncode,
    }
    result = re.search(r"^RESULT (.*)$", child.stdout, re.M)
    if result:
        row.update(json.loads(result[1]))
    check = re.search(r"Check failed: .*", child.stderr)
    if check:
        row["check_failed"] = check[0][:400]
    elif not result:
        row["error"] = child.stderr.strip().splitlines()[-1:] or ["no output"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", choices=sorted(CASES))
    parser.add_argument("--xla-flags", default="")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case)), flush=True)
        return
    # this process leaves the accelerator alone: one process at a time can hold a TPU
    platform = os.environ.get("JAX_PLATFORMS") or "default"
    rows = []
    for flags in [""] + ([args.xla_flags] if args.xla_flags else []):
        for name in args.only or CASES:
            rows.append(probe(name, flags))
            print(rows[-1], flush=True)
            platform = rows[0].get("backend", platform)
            out = pathlib.Path(
                args.out
                or pathlib.Path(__file__).parent
                / "results"
                / f"optimistix_hessian_probe_{platform}.json"
            )
            out.write_text(json.dumps({"platform": platform, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
