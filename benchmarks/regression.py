"""This tree against an earlier revision of boundedloop, side by side in one process:
gradient time (round-robin, shuffled, medians) and body evaluations per gradient on
the foundation workload (adaptive MLP, 8 steps taken).

    python benchmarks/regression.py REV [--rounds 30] [--out FILE]

`REV` is checked out with `git worktree` into a temporary folder and imported under
another name, so both versions are compiled and timed in the same process.
"""

import argparse
import importlib.util
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from _common import EvalCounter, mlp, mlp_weights

import boundedloop as bl


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rev")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    weights, x = mlp_weights(), jnp.ones((1,))
    with tempfile.TemporaryDirectory() as tmp:
        where = pathlib.Path(tmp) / "old"
        old = import_revision(args.rev, where)
        try:
            libs = {"this tree": bl, args.rev: old}
            fns, evals = {}, {}
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
            samples = {k: [] for k in fns}
            order = list(fns)
            rng = random.Random(0)
            for _ in range(args.rounds):
                rng.shuffle(order)
                for k in order:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fns[k](weights, x))
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
    if args.out:
        pathlib.Path(args.out).write_text(
            json.dumps({"rev": args.rev, "rounds": args.rounds, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
