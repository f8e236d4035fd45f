"""A setting read when loops are traced, changed for the length of a `with` block
(the opt-in checks and the progress meter)."""

import contextlib
from collections.abc import Iterator
from typing import Any


class TraceSetting:
    """A value, replaced inside `with setting.set(value):` and restored after."""

    def __init__(self, default: Any):
        self.value = default

    @contextlib.contextmanager
    def set(self, value: Any) -> Iterator[None]:
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous
