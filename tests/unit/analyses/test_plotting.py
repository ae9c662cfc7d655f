"""actstore.query.analyses.plotting: the heatmap puts the value of cell (layer i, head j) where a reader expects it.

The checks read the PNG's pixels back and compare each cell's centre with the colour map's colour
for that cell's value; the centre is computed from the axes' box in figure fractions and the grid
shape alone, not from matplotlib's data transform.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread
from matplotlib.patches import Rectangle

from actstore.core.errors import QueryError
from actstore.query.analyses import plotting
from actstore.query.maps.figures import head_heatmap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOL = 2.5 / 255  # PNG stores 8-bit channels


def _pixels(fig: Figure, dpi: float = 100) -> np.ndarray:
    """The figure rendered as PNG and read back: [height, width, 3] floats in 0..1, row 0 at the top."""
    png = plotting.png_bytes(fig, dpi)
    assert png[:8] == PNG_MAGIC
    return np.asarray(imread(io.BytesIO(png), format="png"))[..., :3]


def _cell_colour(
    fig: Figure, img: np.ndarray, i: int, j: int, shape: tuple[int, int], origin: str = "lower"
) -> np.ndarray:
    """The pixel at the centre of cell (row i, column j) of the first axes' image."""
    n_rows, n_cols = shape
    box = fig.axes[0].get_position()  # figure fractions, y from the bottom
    h, w = img.shape[:2]
    fx = box.x0 + (j + 0.5) / n_cols * box.width
    row_from_bottom = i if origin == "lower" else n_rows - 1 - i
    fy = box.y0 + (row_from_bottom + 0.5) / n_rows * box.height
    return img[int((1 - fy) * h), int(fx * w)]


def _rgb(cmap: str, x: float) -> np.ndarray:
    return np.asarray(matplotlib.colormaps[cmap](x)[:3])


@pytest.mark.parametrize("origin", ["lower", "upper"])
def test_heatmap_puts_each_cell_at_its_layer_and_head(origin: plotting.Origin) -> None:
    L, H, hot = 6, 5, (4, 1)
    grid = np.zeros((L, H))
    grid[hot] = 3.0
    fig = plotting.heatmap(
        grid,
        rows=[f"L{i}" for i in range(L)],
        cols=[f"h{j}" for j in range(H)],
        title="one hot cell",
        origin=origin,
        colorbar_label="score",
    )
    img = _pixels(fig)
    for i in range(L):
        for j in range(H):
            want = _rgb("viridis", 1.0 if (i, j) == hot else 0.0)
            got = _cell_colour(fig, img, i, j, (L, H), origin)
            assert np.allclose(got, want, atol=TOL), ((i, j), got, want)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"L{i}" for i in range(L)]
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"h{j}" for j in range(H)]
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("head", "layer", "one hot cell")
    assert fig.axes[1].get_ylabel() == "score"  # the colour bar


def test_diverging_heatmap_is_symmetric_around_zero_and_leaves_nan_blank() -> None:
    grid = np.zeros((3, 4))
    grid[0, 0], grid[2, 3], grid[1, 2] = -2.0, 1.0, np.nan
    fig = plotting.heatmap(grid, diverging=True)
    img = _pixels(fig)
    cm = plotting.DIVERGING_CMAP
    expect = {(0, 0): _rgb(cm, 0.0), (2, 3): _rgb(cm, 0.75), (0, 1): _rgb(cm, 0.5), (1, 2): np.ones(3)}
    for (i, j), want in expect.items():
        assert np.allclose(_cell_colour(fig, img, i, j, grid.shape), want, atol=TOL), (i, j)
    assert plotting.symmetric_limits(grid) == (-2.0, 2.0)
    assert plotting.symmetric_limits(np.zeros((2, 2))) == (-1.0, 1.0)


def test_explicit_limits_colour_map_and_outlines() -> None:
    grid = np.array([[0.1, 0.5], [0.9, 2.0]])
    fig = plotting.heatmap(grid, cmap="magma", vmin=0.0, vmax=1.0, outline_at_least=0.5, colorbar=False)
    img = _pixels(fig)
    for (i, j), x in {(0, 0): 0.1, (0, 1): 0.5, (1, 0): 0.9, (1, 1): 1.0}.items():  # 2.0 clipped to vmax
        assert np.allclose(_cell_colour(fig, img, i, j, grid.shape), _rgb("magma", x), atol=TOL), (i, j)
    corners = sorted(p.get_xy() for p in fig.axes[0].patches if isinstance(p, Rectangle))
    assert corners == [
        (-0.5, 0.5),
        (0.5, -0.5),
        (0.5, 0.5),
    ]  # (x, y) = (head - 0.5, layer - 0.5) of cells >= 0.5
    assert len(fig.axes) == 1


def test_png_helpers(tmp_path: Path) -> None:
    fig = plotting.heatmap(np.eye(3))
    uri = plotting.data_uri(plotting.png_bytes(fig))
    assert (
        uri.startswith("data:image/png;base64,") and base64.b64decode(uri.split(",", 1)[1])[:8] == PNG_MAGIC
    )
    out = plotting.save_png(fig, tmp_path / "a" / "b" / "h.png", dpi=50)
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert imread(out).shape[:2] == (round(fig.get_figheight() * 50), round(fig.get_figwidth() * 50))
    with pytest.raises(QueryError, match="2-D grid"):
        plotting.heatmap(np.zeros(3))


def test_label_ticks_thins_long_axes() -> None:
    fig, axes = plotting.new_figure()
    ax = axes[0, 0]
    plotting.label_ticks(ax, "x", list(range(40)))
    assert [int(t) for t in ax.get_xticks()] == list(range(0, 40, 2))
    plotting.label_ticks(ax, "y", ["a", "b"])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]


def test_maps_head_heatmap_file(tmp_path: Path) -> None:
    scores = np.zeros((4, 3))
    scores[2, 1] = 0.8
    path = head_heatmap(scores, tmp_path / "maps" / "m.png", "MAPS P17", threshold=0.5)
    img = imread(path)[..., :3]
    top = _rgb("viridis", 1.0)  # vmax defaults to the largest score: the hot cell is the top colour
    assert np.isclose(img, top, atol=TOL).all(axis=-1).sum() > 100


def test_headscore_heatmap_file_is_diverging_around_zero(tmp_path: Path) -> None:
    grid = np.zeros((3, 4))
    grid[1, 2], grid[0, 0] = 2.0, -2.0
    path = plotting.headscore_heatmap(grid, [0, 1, 2], [0, 1, 2, 3], tmp_path / "f" / "hs.png", "HeadScore")
    img = imread(path)[..., :3]
    assert img.shape[:2] == (round((1.5 + 0.2 * 3) * 100), round((1.5 + 0.35 * 4) * 100))
    for x in (0.0, 0.5, 1.0):  # -2 (blue end), 0 (white middle), +2 (red end) all drawn
        assert np.isclose(img, _rgb("RdBu_r", x), atol=TOL).all(axis=-1).sum() > 50


def test_position_classes_follow_rome() -> None:
    # 7 tokens, subject at positions 1..3: before, first, middle, last, first after, further after, last
    got = [plotting.position_class(p, (1, 4), 7) for p in range(7)]
    assert got == [
        None,
        "subject_first",
        "subject_middle",
        "subject_last",
        "first_after",
        "further_after",
        "last",
    ]
    assert plotting.position_class(0, (0, 1), 3) == "subject_first"  # a one-token subject is its first token


class _Fact:
    def __init__(self, n: int, span: tuple[int, int]) -> None:
        self.n_tokens, self.subject_span = n, span
        self.tokens = [f"t{i}" for i in range(n)]
        self.subject, self.object, self.example_id = "s", "o", 0


class _Traced:
    """A TraceResult-like object: ``restored[c]`` [L, T] and ``indirect_effect(c)`` = restored - 0.1."""

    def __init__(self, fact: _Fact, grid: np.ndarray) -> None:
        self.fact, self.restored, self.p_clean, self.p_corrupt = fact, {"resid": grid}, 0.9, 0.1

    def indirect_effect(self, c: str) -> np.ndarray:
        return self.restored[c] - self.p_corrupt


def test_average_by_class_and_trace_figures(tmp_path: Path) -> None:
    a = _Traced(_Fact(4, (1, 3)), np.arange(8, dtype=float).reshape(2, 4))  # classes: -, first, last, last
    b = _Traced(
        _Fact(5, (0, 1)), np.arange(10, dtype=float).reshape(2, 5) * 2
    )  # first, first_after, further x2, last
    avg = plotting.average_by_class([a, b], "resid")
    row = {c: i for i, c in enumerate(plotting.ROLE_ORDER)}
    ie_a, ie_b = a.indirect_effect("resid"), b.indirect_effect("resid")
    np.testing.assert_allclose(avg[row["subject_first"]], (ie_a[:, 1] + ie_b[:, 0]) / 2)
    # a's subject is tokens 1..2: token 2 is subject_last, token 3 (the prompt's last) is "last"
    np.testing.assert_allclose(avg[row["subject_last"]], ie_a[:, 2])
    np.testing.assert_allclose(avg[row["further_after"]], ie_b[:, 2:4].mean(axis=1))
    np.testing.assert_allclose(avg[row["last"]], (ie_a[:, 3] + ie_b[:, 4]) / 2)
    assert np.isnan(avg[row["subject_middle"]]).all()
    for p, size in (
        (plotting.trace_heatmap(a, tmp_path / "trace.png"), ((0.32 * 4 + 1.6), 4.2)),
        (plotting.trace_average_heatmap([a, b], tmp_path / "avg.png"), (3.2, 4.2)),
    ):
        h, w = imread(p).shape[:2]  # one panel (one component) at 110 dpi; matplotlib rounds pixels down
        assert abs(h - size[0] * 110) < 1 and abs(w - size[1] * 110) < 1
