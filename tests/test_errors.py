"""Bad input gets a clear error before the loop is traced."""

import jax
import jax.numpy as jnp
import pytest

import boundedloop as bl


def body(c):
    return c[0] * 2.0, c[1] + 1


def cond(c):
    return c[1] < 3


INIT = (jnp.ones(3), 0)


@pytest.mark.parametrize("bad", [-1, -100])
def test_negative_max_steps(bad):
    with pytest.raises(ValueError, match="max_steps >= 0"):
        bl.while_loop(cond, body, INIT, max_steps=bad)


@pytest.mark.parametrize("bad", [2.5, "8", True, jnp.array(3.0)])
def test_non_integer_max_steps(bad):
    with pytest.raises(TypeError, match="max_steps"):
        bl.while_loop(cond, body, INIT, max_steps=bad)


def test_traced_max_steps():
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda m: bl.while_loop(cond, body, INIT, max_steps=m))(3)


@pytest.mark.parametrize("bad", [0, -3])
def test_checkpoints_below_one(bad):
    with pytest.raises(ValueError, match="checkpoints >= 1"):
        bl.while_loop(cond, body, INIT, max_steps=8, checkpoints=bad)


def test_checkpoints_wrong_type():
    with pytest.raises(TypeError, match="checkpoints"):
        bl.while_loop(cond, body, INIT, max_steps=8, checkpoints=2.0)


@pytest.mark.parametrize("which", ["cond_fun", "body_fun"])
def test_not_callable(which):
    fns = {"cond_fun": cond, "body_fun": body, which: 3}
    with pytest.raises(TypeError, match=f"`{which}` to be callable, got 3"):
        bl.while_loop(fns["cond_fun"], fns["body_fun"], INIT, max_steps=3)
    with pytest.raises(TypeError, match="`f` to be callable"):
        bl.scan(3, INIT, length=2)


def test_body_changes_structure():
    with pytest.raises(TypeError, match="tree structure"):
        bl.while_loop(cond, lambda c: (c[0], c[1] + 1, 0), INIT, max_steps=8)


def test_body_changes_shape_names_the_leaf():
    with pytest.raises(
        TypeError, match=r"carry\[0\] has type float32\[3\].*float32\[6\]"
    ):
        bl.while_loop(
            cond, lambda c: (jnp.concatenate([c[0], c[0]]), c[1] + 1), INIT, max_steps=8
        )


def test_body_changes_dtype_names_the_leaf():
    init = {"x": jnp.ones(3), "n": 0}
    with pytest.raises(TypeError, match=r"carry\['n'\] has type int32\[\].*bool\[\]"):
        bl.while_loop(
            lambda c: c["n"] < 3,
            lambda c: {"x": c["x"], "n": c["n"] > 1},
            init,
            max_steps=8,
        )


def test_body_changes_static_leaf():
    init = (jnp.ones(3), 0, "a")
    with pytest.raises(ValueError, match=r"carry\[2\] is a static value"):
        bl.while_loop(cond, lambda c: (c[0], c[1] + 1, "b"), init, max_steps=8)


def test_body_turns_an_array_leaf_static_or_back():
    init = (jnp.array(0), jnp.array(1.0), jnp.array(2.0))
    with pytest.raises(
        TypeError, match=r"carry\[1\] is float32\[\] but `body_fun` returns 'x' there"
    ):
        bl.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, "x", c[2]), init, max_steps=5
        )
    with pytest.raises(
        TypeError, match=r"carry\[1\] is 'x' but `body_fun` returns float32\[\]"
    ):
        bl.while_loop(
            lambda c: c[0] < 3,
            lambda c: (c[0] + 1, jnp.array(1.0), c[2]),
            (init[0], "x", init[2]),
            max_steps=5,
        )


def test_cond_not_scalar():
    with pytest.raises(TypeError, match="scalar boolean"):
        bl.while_loop(lambda c: c[0] < 3, body, INIT, max_steps=8)


def test_cond_not_boolean():
    with pytest.raises(TypeError, match="scalar boolean"):
        bl.while_loop(lambda c: c[1], body, INIT, max_steps=8)


def test_weak_python_scalars_follow_lax():
    # a Python float in the carry takes the body's dtype, as in lax.while_loop
    out = bl.while_loop(
        lambda c: c[1] < 3,
        lambda c: (c[0] + jnp.float32(1), c[1] + 1),
        (0.0, 0),
        max_steps=5,
    )
    assert out[0].dtype == jnp.float32 and float(out[0]) == 3.0
    # a body returning a bare Python number keeps the carry's dtype
    out = bl.while_loop(
        lambda c: c[1] < 3, lambda c: (1.0, c[1] + 1), (jnp.float32(0), 0), max_steps=5
    )
    assert out[0].dtype == jnp.float32
    # in any float dtype, as weak typing gives it (`x + 1.0` keeps `x`'s dtype;
    # `lax.while_loop` refuses this one); an int is not cast to a bool
    for dtype in (jnp.float16, jnp.bfloat16):
        out = bl.while_loop(
            lambda c: c[1] < 3, lambda c: (1.0, c[1] + 1), (dtype(0), 0), max_steps=5
        )
        assert out[0].dtype == dtype and float(out[0]) == 1.0
    with pytest.raises(TypeError, match=r"carry\[0\] has type bool"):
        bl.while_loop(
            lambda c: c[1] < 3, lambda c: (1, c[1] + 1), (True, 0), max_steps=5
        )


def test_carry_mismatch_names_every_differing_leaf():
    with pytest.raises(TypeError, match="changes 2 carry components") as info:
        bl.while_loop(
            lambda c: True,
            lambda c: (c[0][:2], c[1] > 0, c[2]),
            (jnp.zeros(3), 1, jnp.zeros(2)),
            max_steps=3,
        )
    message = str(info.value)
    assert "carry[0] has type float32[3]" in message
    assert "carry[1] has type int32[]" in message
    assert "carry[2]" not in message
