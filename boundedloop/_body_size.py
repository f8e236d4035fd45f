"""How big a traced body is. The sweeps pick their loop structure by it: nested
loops that save control work on every step pay off for small bodies, whose steps
cost little next to their control, but each is one more loop (and copy of the step)
for XLA to compile, which costs more the larger the body is."""

import jax.extend.core


# bodies up to this many equations (nested ones included) are small
SMALL_BODY = 64


def equations(jaxpr) -> int:
    """Equations in `jaxpr`, those of the jaxprs inside it included."""
    return sum(
        1 + sum(map(equations, jax.extend.core.jaxprs_in_params(e.params)))
        for e in jaxpr.eqns
    )


def is_small(body) -> bool:
    """Whether the traced (closure-converted) `body` has at most `SMALL_BODY`
    equations."""
    return equations(body.jaxpr) <= SMALL_BODY
