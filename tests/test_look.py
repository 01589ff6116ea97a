"""Each picture rendered, with known pixels and counts checked."""

import numpy as np
import torch
from matplotlib.figure import Figure

from workbench import make, with_score
from workbench import look
from workbench.blocks import scan_blocks


def test_block_map_classes_and_grid_of_heads(tmp_path):
    mask = make("per_head_window", {"windows": [1, 300]})
    scan = scan_blocks(mask, 256, 256, heads=2, block_size=64)
    classes = look.block_classes(scan)
    assert classes[0, 0].diag().tolist() == [look.PARTIAL] * 4      # window 1: only the diagonal
    assert classes[0, 0, 3, 0] == look.EMPTY
    assert classes[0, 1, 3, 0] == look.FULL                         # window 300 covers it
    fig = look.block_map(scan, title="t")
    assert isinstance(fig, Figure) and len([a for a in fig.axes if a.get_visible()]) == 2
    img = fig.axes[0].images[0].get_array()
    assert img[3, 0] == look.EMPTY and img[0, 0] == look.PARTIAL
    assert {t.get_text() for t in fig.legends[0].get_texts()} == set(look.BLOCK_LABELS.values())
    fig.savefig(tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_block_map_pools_huge_tables():
    scan = scan_blocks(make("causal"), 4096, 4096, block_size=2)   # 2048 x 2048 blocks
    fig = look.block_map(scan)
    img = fig.axes[0].images[0].get_array()
    assert img.shape == (1024, 1024)
    assert img[0, 1023] == look.EMPTY and img[1023, 0] == look.FULL and img[5, 5] == look.PARTIAL


def test_token_view_is_pixel_exact():
    mask = make("causal_sliding_window", {"window": 4})
    fig = look.token_view(mask, (10, 30), (0, 40))
    img = np.asarray(fig.axes[0].images[0].get_array())
    q, k = np.arange(10, 30)[:, None], np.arange(40)[None, :]
    np.testing.assert_array_equal(img.astype(bool), (q - k >= 0) & (q - k < 4))


def test_overview_fractions_are_exact():
    frac, cq, ck = look.overview_fractions(make("causal"), 1000, 1000, pixels=10)
    assert (cq, ck) == (100, 100)
    assert frac[0, 0] == (100 * 101 / 2) / 10000 and frac[0, 1] == 0 and frac[5, 0] == 1
    fig = look.overview(make("causal"), 1000, 1000, pixels=10)
    assert fig.axes[0].images[0].get_array().shape == (10, 10)


def test_overview_uneven_last_cell():
    frac, cq, ck = look.overview_fractions(make("full"), 105, 95, pixels=10)
    assert (cq, ck) == (11, 10) and torch.all(frac == 1)


def test_score_view_blank_where_masked_and_centered():
    mask = with_score(make("causal"), make("alibi", {"num_heads": 4}))
    values = look.score_values(mask, (0, 20), (0, 20), h=0)
    assert torch.isnan(values[0, 5]) and values[5, 5] == 0
    assert values[10, 0] == -2.0 ** -2 * 10
    fig = look.score_view(mask, (0, 20), (0, 20))
    im = fig.axes[0].images[0]
    assert im.norm.vcenter == 0 and np.ma.is_masked(im.get_array()[0, 5])


def test_diff_view_counts_the_off_by_one():
    a = make("causal_sliding_window", {"window": 8})
    b = make("causal_sliding_window", {"window": 9})
    codes = look.diff_codes(a, b, (0, 50), (0, 50))
    assert int((codes == look.ONLY_B).sum()) == 50 - 8 and int((codes == look.ONLY_A).sum()) == 0
    fig = look.diff_view(a, b, (0, 50), (0, 50))
    assert "42 pairs differ" in fig.axes[0].get_title()
    assert look.count_differences(a, b, 5000, 5000) == 5000 - 8
    assert look.count_differences(a, a, 5000, 5000) == 0


def test_grid_of_heads_ticks_only_the_outer_panels():
    mask = make("per_head_window", {"windows": [1, 8, 16, 32, 64, 128]})
    scan = scan_blocks(mask, 256, 256, heads=6, block_size=32)
    fig = look.block_map(scan)
    panels = [a for a in fig.axes if a.get_visible()]
    assert len(panels) == 6
    fig.canvas.draw()
    has_x = [len(a.get_xticks()) > 0 for a in panels]
    has_y = [len(a.get_yticks()) > 0 for a in panels]
    # 4 columns: h=2, h=3 are the lowest of their columns in a ragged grid, h=4, h=5 the bottom row
    assert has_x == [False, False, True, True, True, True]
    assert has_y == [True, False, False, False, True, False]
    assert {a.images[0].get_extent() == [0, 256, 256, 0] for a in panels} == {True}
