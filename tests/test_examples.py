"""The examples run, small enough for CI, and do what they claim."""

import importlib.util
import pathlib

import jax
import pytest


EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart():
    results, err = load("quickstart").main(quick=True)
    assert err < 1e-4
    assert set(results) == {8, 64}


def test_library_pattern():
    assert load("library_pattern").main() < 1e-5


@pytest.mark.slow
def test_train_loss_falls():
    # optax itself relies on standard dtype promotion
    with jax.numpy_dtype_promotion("standard"):
        losses = load("train").main(steps=100)
    assert losses[-1] < 0.05 * losses[0]


def test_neural_ode_loss_falls():
    pytest.importorskip("diffrax")
    # optax itself relies on standard dtype promotion
    with jax.numpy_dtype_promotion("standard"):
        losses = load("neural_ode").main(steps=30)
    assert losses[-1] < 0.5 * losses[0]


def test_optimistix_bilevel_loss_falls():
    pytest.importorskip("optimistix")
    losses = load("optimistix_bilevel").main(outer_steps=3)
    assert losses[-1] < 0.8 * losses[0]
