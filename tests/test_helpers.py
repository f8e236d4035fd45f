"""The tests' own tolerance rule off the CPU (`helpers.tree_allclose`), on the values
a TPU v5e gave at 51b94ec, with the backend's name patched: the accelerator's floor
accepts rounding that is small against an array's largest element, and still
rejects a wrong answer."""

from unittest import mock

import jax
import numpy as np

from .helpers import tree_allclose


# `test_properties.py`'s `tuple-max23-ckpt3-vmap` gradient: the TPU's, the host's
ON_TPU = np.array([0.36554697, 0.02208329, 0.02746588], np.float32)
ON_HOST = np.array([0.3655635, 0.02193987, 0.02754355], np.float32)


def test_the_accelerator_floor_is_relative_to_the_arrays_largest_element():
    # the rule is read from the backend's name, patched both ways, so that this
    # test holds on any machine (it failed on the chip where it assumed a CPU)
    with mock.patch.object(jax, "default_backend", lambda: "cpu"):
        assert not tree_allclose(ON_TPU, ON_HOST)  # element-wise, tight
    with mock.patch.object(jax, "default_backend", lambda: "tpu"):
        assert tree_allclose(ON_TPU, ON_HOST)  # 3.9e-4 of the largest element
        assert not tree_allclose(ON_TPU * 1.01, ON_HOST)  # 1% off everywhere
        wrong = ON_TPU + np.array([0.0, 0.002, 0.0], np.float32)
        assert not tree_allclose(
            wrong, ON_HOST
        )  # one element off by 5e-3 of the largest
