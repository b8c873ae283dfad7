"""Layouts: pure per-device boxes agree with JAX, and box arithmetic is exact."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxreshard.planning.layout import (
    Layout,
    LayoutError,
    box_size,
    contiguous_runs,
    split_flat,
    split_rows,
)

MESHES = [
    ((8,), ("x",)),
    ((2, 4), ("a", "b")),
    ((4, 2), ("fsdp", "tp")),
    ((2, 2, 2), ("p", "q", "r")),
    ((2, 1, 2, 2), ("a", "b", "c", "d")),
]


def _specs(names: tuple[str, ...], ndim: int):
    options = [None, *names, *itertools.permutations(names, 2)]
    for spec in itertools.product(options, repeat=ndim):
        used = [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]
        if len(used) == len(set(used)):
            yield P(*spec)


@pytest.mark.parametrize(("mesh_shape", "names"), MESHES)
def test_from_mesh_matches_jax_devices_indices_map(devices, mesh_shape, names):
    order = np.random.default_rng(sum(mesh_shape)).permutation(8)
    mesh = Mesh(np.array([devices[i] for i in order]).reshape(mesh_shape), names)
    shape = (16, 8)
    for spec in _specs(names, 2):
        sharding = NamedSharding(mesh, spec)
        pure = Layout.from_mesh(shape, mesh_shape, names, [int(i) for i in order], spec)
        jax_view = Layout.from_sharding(sharding, shape)  # devices_indices_map: JAX's own boxes
        assert (pure.shape, pure.devices, pure.boxes) == (
            jax_view.shape,
            jax_view.devices,
            jax_view.boxes,
        ), spec


def test_from_mesh_rejects_specs_that_do_not_fit():
    with pytest.raises(LayoutError, match="does not divide"):
        Layout.from_mesh((6,), (4,), ("x",), range(4), ("x",))
    with pytest.raises(LayoutError, match="rank"):
        Layout.from_mesh((8,), (4,), ("x",), range(4), ("x", None))
    with pytest.raises(LayoutError, match="not in the mesh axes"):
        Layout.from_mesh((8,), (4,), ("x",), range(4), ("y",))


def test_from_mesh_rejects_meshes_and_specs_jax_would_not_build():
    """Regression: duplicate axis names (which JAX's Mesh refuses) gave a meaningless layout,
    a negative dimension gave boxes with negative bounds, and an axis-count mismatch or an
    UNCONSTRAINED entry raised Python's own errors instead of `LayoutError`."""
    with pytest.raises(LayoutError, match="one distinct name per axis"):
        Layout.from_mesh((8, 8), (2, 4), ("a", "a"), range(8), ("a", None))
    with pytest.raises(LayoutError, match="one distinct name per axis"):
        Layout.from_mesh((8,), (2, 2), ("a",), range(4), ("a",))
    with pytest.raises(LayoutError, match="negative or empty sizes"):
        Layout.from_mesh((-4,), (2,), ("a",), [0, 1], ("a",))
    with pytest.raises(LayoutError, match="unconstrained"):
        Layout.from_mesh((8,), (2,), ("a",), [0, 1], (P.UNCONSTRAINED,))


def test_scalar_layout_holds_one_element_everywhere():
    layout = Layout.from_mesh((), (4,), ("x",), range(4), ())
    assert layout.boxes == ((),) * 4
    assert box_size(()) == 1


def test_overlapping_finds_exactly_the_meeting_boxes():
    layout = Layout.from_mesh((8, 8), (2, 2), ("a", "b"), range(4), ("a", "b"))
    found = list(layout.overlapping(((2, 6), (0, 3))))
    assert [(held, ids) for held, ids, _ in found] == [
        (((0, 4), (0, 4)), (0,)),
        (((4, 8), (0, 4)), (2,)),
    ]
    assert [common for _, _, common in found] == [((2, 4), (0, 3)), ((4, 6), (0, 3))]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 1, 6)])
def test_split_flat_covers_every_range_exactly(shape):
    box = tuple((1, 1 + n) for n in shape)
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    for start in range(flat.size + 1):
        for stop in range(start, flat.size + 1):
            parts = split_flat(box, start, stop)
            assert len(parts) <= 2 * len(shape)
            got = np.concatenate(
                [flat[tuple(slice(a - 1, b - 1) for a, b in p)].reshape(-1) for p in parts]
                or [np.zeros(0, int)]
            )
            np.testing.assert_array_equal(got, np.arange(start, stop))


def test_split_rows_cuts_the_outermost_dimension():
    assert split_rows(((0, 1), (0, 6), (0, 2)), [4, 0, 8]) == [
        ((0, 1), (0, 2), (0, 2)),
        ((0, 1), (2, 6), (0, 2)),
    ]


def _runs_by_numpy(box, shape) -> int:
    """Oracle: the box's elements' flat offsets in a C-order array of ``shape``, counted where
    one does not follow the previous one."""
    offsets = np.arange(int(np.prod(shape))).reshape(shape)[tuple(slice(a, b) for a, b in box)]
    flat = offsets.reshape(-1)
    return 1 + int(np.count_nonzero(np.diff(flat) != 1)) if flat.size else 0


@pytest.mark.parametrize("shape", [(6,), (4, 6), (3, 4, 5), (2, 1, 3, 4)])
def test_contiguous_runs_counts_the_rows_a_box_covers(shape):
    """Every box of a few small arrays, against NumPy's own offsets."""
    ranges = [[(a, b) for a in range(n) for b in range(a + 1, n + 1)] for n in shape]
    for box in itertools.product(*ranges):
        assert contiguous_runs(box, shape) == _runs_by_numpy(box, shape), box


def test_contiguous_runs_by_hand():
    assert contiguous_runs(((0, 128), (0, 64)), (128, 128)) == 128  # half the columns: rows
    assert contiguous_runs(((0, 128), (0, 64)), (256, 64)) == 1  # whole rows: one run
    assert contiguous_runs((), ()) == 1  # a scalar


def test_overlapping_on_a_layout_that_is_not_a_grid_skips_boxes_that_only_touch():
    """Boxes that share only an edge hold no common element: a hand-built layout that is not
    a grid (scanned, not searched) yields only the box the query really meets."""
    top = ((0, 2), (0, 4))
    layout = Layout((4, 4), (0, 1, 2), (top, ((2, 4), (0, 2)), ((2, 4), (2, 4))))
    assert list(layout.overlapping(top)) == [(top, (0,), top)]
    assert [h for h, _, _ in layout.overlapping(((1, 3), (1, 2)))] == [top, ((2, 4), (0, 2))]


def test_from_mesh_refuses_a_spec_naming_an_axis_twice_as_jax_does():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    with pytest.raises(Exception, match="duplicate"):  # JAX's own refusal of the same spec
        NamedSharding(mesh, P("x", "x")).devices_indices_map((8, 8))
    with pytest.raises(LayoutError, match="uses a mesh axis twice"):
        Layout.from_mesh((8, 8), (4,), ("x",), range(4), ("x", "x"))
    with pytest.raises(LayoutError, match="uses a mesh axis twice"):
        Layout.from_mesh((16, 8), (2, 2), ("x", "y"), range(4), (("x", "y", "x"),))


def test_from_mesh_refuses_a_mesh_axis_of_size_zero():
    with pytest.raises(LayoutError, match="negative or empty sizes"):
        Layout.from_mesh((8,), (0,), ("x",), [], (None,))
    with pytest.raises(LayoutError, match="negative or empty sizes"):
        Layout.from_mesh((8,), (2, 0), ("x", "y"), [], ("y",))
