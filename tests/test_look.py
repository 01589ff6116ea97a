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
    # ALiBi only lowers scores: a one-sided scale from the lowest value to 0, masked cells blank
    assert (im.norm.vmin, im.norm.vmax) == (float(np.nanmin(values.numpy())), 0.0)
    assert im.cmap.name.startswith("Blues_r") and np.ma.is_masked(im.get_array()[0, 5])


def test_score_view_of_both_signs_diverges_around_zero():
    from workbench import Mask

    def tilt(score, b, h, q_idx, kv_idx):  # raises near keys, lowers far ones
        return score + (kv_idx - q_idx + 5).float()

    fig = look.score_view(Mask("tilt", mask_mod=make("causal").mask_mod, score_mod=tilt), (0, 20), (0, 20))
    norm = fig.axes[0].images[0].norm
    assert norm.vcenter == 0 and norm.halfrange == 14


def test_focus_finds_the_structure_and_says_why():
    tree = make("tree", q_len=4096, kv_len=4096)
    where = look.focus(scan_blocks(tree, 4096, 4096), 512, mask=tree)
    assert where.q_range[0] >= 4096 - 64 and where.kv_range[0] >= 4096 - 64  # the 15 tree tokens, close up
    assert "differs from plain causal" in where.reason and "closer view" in where.reason
    window = make("causal_sliding_window", {"window": 256})
    where = look.focus(scan_blocks(window, 4096, 4096), 512, mask=window)
    assert where.block == (2, 0) and where.q_range == (64, 576)  # the window's lower edge, in view
    causal = make("causal", q_len=100, kv_len=3000)
    where = look.focus(scan_blocks(causal, 100, 3000), 512)
    assert where.kv_range == (2488, 3000) and "start of the diagonal" in where.reason
    # per head: each head's own structure
    heads = make("per_head_window", q_len=4096, kv_len=4096)
    scan = scan_blocks(heads, 4096, 4096, heads=8)
    assert look.focus(scan, 512, h=3).block == (2, 0) and look.focus(scan, 512, h=4).block == (4, 0)
    assert "diagonal" in look.focus(scan, 512, h=7).reason  # window 4,096: plain causal at this length


def test_block_map_of_16_heads_is_legible():
    import matplotlib.text

    mask = make("per_head_window", {"windows": [16 * i + 8 for i in range(16)]}, q_len=1024, kv_len=1024)
    fig = look.block_map(scan_blocks(mask, 1024, 1024, heads=16), title=mask.name)
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text() and t.get_visible()]
    labels = [t.get_text() for t in texts]
    assert all(f"h={h}" in labels for h in range(16))  # every head has its panel
    assert min(t.get_fontsize() for t in texts) >= 9 and fig.get_figwidth() <= 12
    png = fig._repr_png_()
    assert png[:4] == b"\x89PNG"


def test_block_grid_pools_and_keeps_counts():
    mask = make("causal")
    scan = scan_blocks(mask, 4096, 4096, block_size=16)  # 256 x 256 blocks
    grid = look.block_grid(scan, max_cells=64)
    assert grid.classes.shape == (64, 64) and (grid.pool_q, grid.pool_kv) == (4, 4)
    assert grid.kept.sum() == scan.kept_pairs and grid.kept[0, 0] == 64 * 65 // 2


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
