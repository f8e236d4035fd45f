"""A value that must cross a trace: written while a function is traced, read by a
rule that runs later. Unlike a plain dict, the store says when it is read before
it is written, and when a second trace writes a value other than the first's."""


class CheckedStore:
    """Holds one value, set by the first trace and checked by every later one."""

    def __init__(self, what: str):
        self.what = what
        self._value = None
        self._set = False

    def set(self, value) -> None:
        if self._set and value != self._value:
            raise AssertionError(
                f"boundedloop internal error: {self.what} changed between two traces "
                f"({self._value} then {value}); please report it."
            )
        self._value, self._set = value, True

    def get(self):
        if not self._set:
            raise AssertionError(
                f"boundedloop internal error: {self.what} read before it was traced; "
                "please report it."
            )
        return self._value
