"""Every transform of a loop whose step `i` reads the row step `i - 1` wrote,
`where(i > 0, buf[max(i - 1, 0)], x)` (the pattern XLA's TPU while-loop simplifier
miscompiles), against the same computation on the host CPU backend: `lax.scan`,
ours at counts of checkpoints and at `memory=` budgets (with and without declared
buffers), and equinox's loops. The largest absolute error per transform.
Internal: it plans the small step as costly (`_cost_model.is_cheap` and
`stores_before_taping` off), so that the budgets take the taped paths they take for
costly steps, which the stored path (`checkpoints=None`'s program at `max_steps`)
would otherwise hide.

    python benchmarks/internal/transforms_probe.py   (on the TPU)

Result: `benchmarks/results/transforms_probe_tpu_<commit>.txt`.
"""

import equinox.internal as eqxi
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

import boundedloop as bl
from boundedloop._api import _memory_plan
from boundedloop._sweeps import _tape


# the small step planned as costly, so that budgets take the tape's paths
_tape.is_cheap = _memory_plan.is_cheap = lambda body: False
_tape.stores_before_taping = _memory_plan.stores_before_taping = lambda body: False
jax.config.update("jax_default_matmul_precision", "highest")
W = np.array([[0.9, -0.4, 0.3], [0.2, 0.8, -0.5], [-0.3, 0.1, 0.7]], np.float32)
X0 = np.array([0.3, -0.2, 0.5], np.float32)
V = np.array([0.7, -1.1, 0.4], np.float32)
rows = 6


def body(c):
    x, buf, i, n = c
    prev = jnp.where(i > 0, buf[jnp.maximum(i - 1, 0)], x)
    return x, buf.at[i].set(jnp.tanh(W @ prev + 0.1) * x), i + 1, n


def cond(c):
    return c[2] < c[3]


def init(x):
    return (x, jnp.zeros((rows, 3)), jnp.array(0), jnp.array(4))


def ref(x):
    return lax.scan(lambda c, _: (body(c), None), init(x), length=4)[0][1]


def transforms(f):
    return {
        "primal": lambda: jax.jit(f)(X0),
        "jvp": lambda: jax.jit(lambda x, v: jax.jvp(f, (x,), (v,))[1])(X0, V),
        "jacfwd": lambda: jax.jit(jax.jacfwd(f))(X0),
        "jacrev": lambda: jax.jit(jax.jacrev(f))(X0),
        "grad": lambda: jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(X0),
        "vmap jvp": lambda: jax.jit(jax.vmap(lambda x: jax.jvp(f, (x,), (V,))[1]))(
            jnp.stack([X0, -X0])
        ),
    }


cpu = jax.devices("cpu")[0]
with jax.default_device(cpu):
    truth = {k: np.asarray(t()) for k, t in transforms(ref).items()}
loops = {"lax.scan": ref}
for ck in (1, 2, None, "150B", "300B", "1000B"):
    for ub in (True, False):
        kw = dict(buffers=lambda c: c[1]) if ub else {}
        kw.update(
            dict(memory=int(ck[:-1])) if isinstance(ck, str) else dict(checkpoints=ck)
        )
        loops[f"bl ck={ck} buffers={'y' if ub else 'n'}"] = lambda x, kw=kw: (
            bl.while_loop(cond, body, init(x), max_steps=rows, **kw)[1]
        )
for kind in ("checkpointed", "bounded"):
    loops[f"eqx {kind}"] = lambda x, kind=kind: eqxi.while_loop(
        cond, body, init(x), max_steps=rows, kind=kind
    )[1]
print(jax.devices()[0].platform, flush=True)
for name, f in loops.items():
    errs = []
    for k, t in transforms(f).items():
        try:
            errs.append(f"{k} {float(np.max(np.abs(np.asarray(t()) - truth[k]))):.0e}")
        except Exception as e:
            errs.append(f"{k} ERR {type(e).__name__}")
    print(f"{name:24s} " + "  ".join(errs), flush=True)
