"""Buffer indices: what `buf[idx]` and `buf.at[idx]` accept (NumPy's basic indices,
as `docs/guides/buffers.md`, "What a buffer supports", lists them), split into a
static pattern and traced integers, and reads and writes through them that stay in
place: one `lax.dynamic_slice` / `lax.dynamic_update_slice` of the window the index
covers (a strided slice takes a static gather or scatter inside that window).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Int


SUPPORTED = (
    "A buffer index is any combination of integers (Python ints or traced integer "
    "scalars), slices with static bounds (`1:`, `:k` for a Python int `k`, `::2`) "
    "and `...`, e.g. `buf[i]`, `buf[i, j]`, `buf[i, 1:]`, `buf[..., i]` or "
    "`buf[...]`."
)


class Index(eqx.Module):
    """A normalised index into an array of a given shape.

    `pattern[a]` is `None` where axis `a` is picked by an integer (the next of
    `ints`), else `(start, size, step)`, a static slice with `size` elements.
    """

    pattern: tuple = eqx.field(static=True)
    ints: tuple[Int[Array, ""], ...]
    # the integers, where all were Python integers; else None
    static_ints: tuple[int, ...] | None = eqx.field(static=True, default=None)

    def result_shape(self) -> tuple[int, ...]:
        return tuple(p[1] for p in self.pattern if p is not None)

    def in_bounds(self, shape) -> Bool[Array, ""]:
        """Whether every integer of the index is in range (`-dim <= i < dim`): a
        `jnp` write at an out-of-range index is dropped."""
        dims = [dim for p, dim in zip(self.pattern, shape) if p is None]
        inside = jnp.array(True)
        for i, dim in zip(self.ints, dims):
            inside = inside & (i >= -dim) & (i < dim)
        return inside

    def describe(self, shape=None) -> str:
        """The index as it is written, `[3, 1:4]` (`i` for a traced integer)."""
        ints = self.ints if self.static_ints is None else self.static_ints
        return describe_index(self.pattern, ints, shape)

    def window(self, shape):
        """The covered box: `(starts, sizes, positions)`, where `positions[a]` are
        the static offsets the index takes inside the box along axis `a`, or `None`
        where it takes all of it in order."""
        ints = iter(self.ints)
        starts, sizes, positions = [], [], []
        for p, dim in zip(self.pattern, shape):
            if p is None:
                i = next(ints)
                starts.append(jnp.where(i < 0, i + dim, i).astype(jnp.int32))
                sizes.append(1)
                positions.append(None)
                continue
            start, size, step = p
            low = start if step > 0 else start + (size - 1) * step
            starts.append(jnp.array(low if size else 0, jnp.int32))
            sizes.append((size - 1) * abs(step) + 1 if size else 0)
            offsets = start - low + step * np.arange(size)
            positions.append(None if step == 1 else offsets)
        return starts, sizes, positions

    def coordinates(self, shape) -> list[Int[Array, " n"]]:
        """Per axis, the coordinates the index takes (clamped as `get` does)."""
        starts, sizes, positions = self.window(shape)
        out = []
        for start, size, pos, dim in zip(starts, sizes, positions, shape):
            start = jnp.clip(start, 0, max(dim - size, 0))
            offsets = np.arange(size) if pos is None else pos
            out.append(start + jnp.asarray(offsets, jnp.int32))
        return out


def describe_index(pattern: tuple, ints, shape=None) -> str:
    """An index of static `pattern` (`Index.pattern`) as it is written, `[3, 1:4]`,
    with `ints` for its integers (`i` for a traced one). With the buffer's `shape`,
    a slice over a whole axis is `:`, and trailing ones are left out."""
    ints = iter(ints)
    shape = [None] * len(pattern) if shape is None else shape
    parts = []
    for p, dim in zip(pattern, shape):
        if p is None:
            i = next(ints)
            parts.append("i" if isinstance(i, jax.core.Tracer) else str(int(i)))
            continue
        start, size, step = p
        if (start, size, step) == (0, dim, 1):
            parts.append(":")
            continue
        stop = start + size * step
        end = "" if step < 0 and stop < 0 else str(stop)
        parts.append(f"{start}:{end}" + ("" if step == 1 else f":{step}"))
    while len(parts) > 1 and parts[-1] == ":":
        parts.pop()
    return f"[{', '.join(parts)}]"


def make_index(idx, shape: tuple[int, ...]) -> Index:
    """Normalise `idx` (as given to `buf[idx]`) for an array of shape `shape`."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    ellipses = [n for n, i in enumerate(idx) if i is Ellipsis]
    if len(ellipses) > 1:
        raise IndexError(f"A buffer index can have at most one `...`. {SUPPORTED}")
    if ellipses:
        k = ellipses[0]
        fill = len(shape) - (len(idx) - 1)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1 :]
    if len(idx) > len(shape):
        raise IndexError(
            f"Too many indices for a buffer of rank {len(shape)}: got {len(idx)}."
        )
    idx = idx + (slice(None),) * (len(shape) - len(idx))
    pattern, ints, static = [], [], []
    for i, dim in zip(idx, shape):
        if isinstance(i, slice):
            pattern.append(_static_slice(i, dim))
        else:
            if isinstance(i, int | np.integer) and not -dim <= i < dim:
                raise IndexError(
                    f"Buffer index {int(i)} is out of bounds for an axis of size "
                    f"{dim} (a buffer of shape {tuple(shape)})."
                )
            if isinstance(i, int | np.integer):
                static.append(int(i))
            ints.append(_integer(i))
            pattern.append(None)
    known = tuple(static) if len(static) == len(ints) else None
    return Index(tuple(pattern), tuple(ints), known)


def _static_slice(s: slice, dim: int) -> tuple[int, int, int]:
    for bound in (s.start, s.stop, s.step):
        if bound is not None and not isinstance(bound, int | np.integer):
            raise TypeError(
                f"A buffer slice needs static (Python int) bounds, got {s!r}. "
                f"{SUPPORTED} For a traced start, index with an integer per step, "
                "or use `lax.dynamic_slice` on an ordinary array."
            )
    start, stop, step = s.indices(dim)
    return start, len(range(start, stop, step)), step


def _integer(i) -> Int[Array, ""]:
    if i is None or isinstance(i, bool | np.bool_):
        raise TypeError(f"Buffers do not take `None` or boolean indices. {SUPPORTED}")
    if isinstance(i, int | np.integer):
        return jnp.array(i, jnp.int32)
    i = jnp.asarray(i) if not isinstance(i, jax.Array) else i
    if i.shape != () or not jnp.issubdtype(i.dtype, jnp.integer):
        raise TypeError(
            f"Buffers take scalar integers (or static slices) as indices, got an index of type "
            f"{jnp.dtype(i.dtype).name}{list(i.shape)}. {SUPPORTED}"
        )
    return i.astype(jnp.int32)


def get(array, index: Index):
    """`array[index]`."""
    starts, sizes, positions = index.window(array.shape)
    out = lax.dynamic_slice(array, starts, sizes)
    if any(p is not None for p in positions):
        out = out[_static_positions(positions, sizes)]
    return out.reshape(index.result_shape())


def put(array, index: Index, value, pred: Bool[Array, ""] | bool = True):
    """`array.at[index].set(value)`, where `pred` is true; in place."""
    value = jnp.broadcast_to(jnp.asarray(value), index.result_shape())
    value = value.astype(array.dtype)
    if pred is not True:
        value = jnp.where(pred, value, get(array, index))
    starts, sizes, positions = index.window(array.shape)
    full_shape = [1 if p is None else p[1] for p in index.pattern]
    value = value.reshape(full_shape)
    if any(p is not None for p in positions):
        window = lax.dynamic_slice(array, starts, sizes)
        value = window.at[_static_positions(positions, sizes)].set(value)
    return lax.dynamic_update_slice(array, value, starts)


def _static_positions(positions, sizes):
    axes = [np.arange(n) if p is None else p for p, n in zip(positions, sizes)]
    return np.ix_(*axes)


def overlay(value, read: Index, write: Index, written, shape):
    """`value` (read at `read` before a write) after `written` was written at
    `write`, in an array of shape `shape`; and where it was overwritten.

    **Returns:**

    `(value, overwritten)`, both shaped like `value`.
    """
    read_full = [1 if p is None else p[1] for p in read.pattern]
    write_full = [1 if p is None else p[1] for p in write.pattern]
    read_coords = read.coordinates(shape)
    write_coords = write.coordinates(shape)
    mask, local = jnp.array(True), []
    for a, (rp, wp) in enumerate(zip(read.pattern, write.pattern)):
        if rp is not None and rp == wp:  # the same static slice: all of it, in order
            local.append(None)
            continue
        # where each read coordinate falls among the write's coordinates
        hits = read_coords[a][:, None] == write_coords[a][None, :]
        inside = jnp.any(hits, axis=1)
        mask = mask & inside.reshape([-1 if b == a else 1 for b in range(len(shape))])
        local.append(jnp.argmax(hits, axis=1))
    written = jnp.reshape(written, write_full)
    if any(x is not None for x in local):
        axes = [np.arange(n) if x is None else x for x, n in zip(local, write_full)]
        written = written[jnp.ix_(*axes)]
    mask = jnp.broadcast_to(mask, read_full).reshape(read.result_shape())
    written = written.reshape(read.result_shape())
    return jnp.where(mask, written, value), mask
