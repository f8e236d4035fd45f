"""Our checkpointed gradient beside Enzyme-JAX's binomial checkpointing of a
`stablehlo.while` (issue 53's CPU workload): a 64-element `x <- tanh(W @ x + b)` run
for a traced `n = 256` steps of at most 1024, 16 checkpoints, gradient with respect
to `W`. Beside them equinox's checkpointed loop (16 checkpoints, same bound) and
`lax.scan` over the 256 steps, storing every one.

    pip install enzyme_ad==0.0.16   # not a dependency of the project
    python benchmarks/enzyme_peer.py [--rounds 200] [--compiles 7]

Enzyme's checkpointing has no Python switch in 0.0.16: the counter loop
`lax.while_loop(i < n, ...)` is lowered, three attributes are set on its
`stablehlo.while` (`enzyme.enable_checkpointing`, `enzyme.binomial_checkpointing`,
`enzyme.checkpoint_period` = 16) and the edited module runs through
`enzyme_ad.jax.hlo_call`. Its limits in 0.0.16: the loop must count to a limit (a
traced limit is fine; a stop on the data fails to compile), and `vmap` has no
batching rule. Per gradient: time (medians of interleaved rounds after warm-up),
compiled temporary memory, lowering (trace included) and XLA compile time (medians
of fresh compiles, each after `jax.clear_caches()`, interleaved), while loops in the
optimized program. Results: `benchmarks/results/enzyme_peer.json`.
"""

import argparse
import importlib.metadata
import statistics
import time

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from _common import clear_caches, interleaved_medians, temp_bytes, write_results
from _format import load, nbytes, page, seconds, table
from jax import lax

import boundedloop as bl


D, N, MAX_STEPS, CHECKPOINTS = 64, 256, 1024, 16
B = jnp.full((D,), 0.01)
RESULTS = "benchmarks/results/enzyme_peer.json"


def arguments():
    w = jax.random.normal(jax.random.key(0), (D, D)) / 16
    return w, jnp.ones(D), jnp.int32(N)


def _counter_loop(w, x0, n):
    def body(c):
        return c[0] + 1, jnp.tanh(w @ c[1] + B)

    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x0))[1]


def enzyme_loss():
    """The loss through Enzyme's checkpointed counter loop, or None without
    `enzyme_ad`."""
    try:
        from enzyme_ad.jax import hlo_call
    except ImportError:
        return None
    from jax.interpreters import mlir
    from jaxlib.mlir import ir

    with mlir.make_ir_context():
        module = ir.Module.parse(jax.jit(_counter_loop).lower(*arguments()).as_text())
        loops = []

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if inner.operation.name == "stablehlo.while":
                            loops.append(inner.operation)
                        walk(inner.operation)

        walk(module.operation)
        (loop,) = loops
        loop.attributes["enzyme.enable_checkpointing"] = ir.BoolAttr.get(True)
        loop.attributes["enzyme.binomial_checkpointing"] = ir.UnitAttr.get()
        i64 = ir.IntegerType.get_signless(64)
        period = ir.IntegerAttr.get(i64, CHECKPOINTS)
        loop.attributes["enzyme.checkpoint_period"] = period
        source = str(module)

    def loss(w, x0, n):
        out = hlo_call(w, x0, n, source=source, passes="lower-enzymexla-math")
        return jnp.sum(out[0] if isinstance(out, (tuple, list)) else out)

    return loss


def _loss(kind: str):
    """`(W, x0, n) -> sum(x_n)` through the loop `kind`."""
    if kind == "Enzyme-JAX":
        return enzyme_loss()

    def loss(w, x0, n):
        def body(c):
            return c[0] + 1, jnp.tanh(w @ c[1] + B)

        def cond(c):
            return c[0] < n

        if kind == "boundedloop":
            _, x = bl.while_loop(
                cond, body, (0, x0), max_steps=MAX_STEPS, checkpoints=CHECKPOINTS
            )
        elif kind == "equinox":
            _, x = eqxi.while_loop(
                cond,
                body,
                (0, x0),
                max_steps=MAX_STEPS,
                kind="checkpointed",
                checkpoints=CHECKPOINTS,
            )
        else:  # lax.scan over the N steps, every one stored
            x, _ = lax.scan(lambda x, _: (jnp.tanh(w @ x + B), None), x0, length=N)
        return jnp.sum(x)

    return loss


KINDS = ["boundedloop", "Enzyme-JAX", "equinox", "lax.scan"]


def measure(rounds: int, compiles: int) -> dict:
    args = arguments()
    losses = {k: _loss(k) for k in KINDS}
    grads = {k: jax.grad(loss) for k, loss in losses.items() if loss is not None}
    reference = jax.jit(grads["lax.scan"])(*args)
    lower, compile_, exes = {k: [] for k in grads}, {k: [] for k in grads}, {}
    for r in range(compiles + 1):  # the first is a warm-up
        for kind, grad in grads.items():
            clear_caches()
            t0 = time.perf_counter()
            lowered = jax.jit(grad).lower(*args)
            t1 = time.perf_counter()
            exes[kind] = lowered.compile()
            if r:
                lower[kind].append(t1 - t0)
                compile_[kind].append(time.perf_counter() - t1)
    times = interleaved_medians(exes, {k: args for k in exes}, rounds)
    rows = {}
    for kind, exe in exes.items():
        error = float(jnp.max(jnp.abs(exe(*args) - reference)))
        rows[kind] = dict(
            grad_s=times[kind],
            temp_bytes=temp_bytes(exe),
            lower_s=statistics.median(lower[kind]),
            compile_s=statistics.median(compile_[kind]),
            whiles=exe.as_text().count(" while("),
            max_error=error,
        )
    return rows


def enzyme_table() -> str:
    """The docs' table of `benchmarks/results/enzyme_peer.json`."""
    found = load("enzyme_peer.json")
    rows = found["rows"]
    scan = rows["lax.scan"]
    body = [
        [
            kind,
            seconds(r["grad_s"]),
            f"{r['grad_s'] / scan['grad_s']:.2f}",
            nbytes(r["temp_bytes"]),
            seconds(r["lower_s"]),
            seconds(r["compile_s"]),
            f"{r['compile_s'] / scan['compile_s']:.2f}",
            r["whiles"],
        ]
        for kind, r in rows.items()
    ]
    header = [
        "gradient",
        "time",
        "over lax.scan",
        "temp memory",
        "trace + lower",
        "XLA compile",
        "over lax.scan",
        "while loops",
    ]
    note = (
        f"On {found['machine_note']} (jax {found['jax']}, enzyme_ad "
        f"{found['enzyme_ad']}): `python benchmarks/enzyme_peer.py`, "
        f"{found['rounds']} interleaved rounds, compile medians of "
        f"{found['compiles']} fresh compiles; `lax.scan` runs the 256 steps and "
        "stores every one."
    )
    return page(note, table(header, body))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--compiles", type=int, default=7)
    parser.add_argument("--machine-note", default="a 2-core CPU")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    try:
        version = importlib.metadata.version("enzyme_ad")
    except importlib.metadata.PackageNotFoundError:
        version = None
    rows = measure(args.rounds, args.compiles)
    for kind, row in rows.items():
        print(kind, row, flush=True)
    write_results(
        args.out,
        jax=jax.__version__,
        enzyme_ad=version,
        rounds=args.rounds,
        compiles=args.compiles,
        machine_note=args.machine_note,
        workload=dict(width=D, n=N, max_steps=MAX_STEPS, checkpoints=CHECKPOINTS),
        rows=rows,
    )


if __name__ == "__main__":
    main()
