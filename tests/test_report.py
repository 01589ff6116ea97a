"""The main job's report: what a reader sees agrees with the CSV/JSON, says its lengths and says
each finding once."""

import csv
import json

from workbench.report import run_report


def test_report_overview_agrees_with_the_summary(tmp_path):
    run_report([("tree", {}), ("per_head_window", {}), ("causal_sliding_window", {"window": 64})], tmp_path,
               q_len=1024, device="cpu", progress=False)
    rows = {r["name"]: r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    tree, heads = rows["tree_15nodes"], rows["per_head_window_8heads"]
    assert tree["full_blocks"].isdigit() and tree["kept_pairs"].isdigit()  # counts, not 2112.0
    assert json.loads(tree["params"])["parents"][:3] == [-1, 0, 0]  # the defaults used, not {}
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert "row_intervals" in heads["exact_backends"].split() and "block_sparse" in heads["exact_backends"].split()
    summary = json.loads((tmp_path / "summary.json").read_text())
    by_name = {m["name"]: m for m in summary["masks"]}
    assert by_name["per_head_window_8heads"]["stats"]["heads"] == 8  # all its heads, not the report's 4
    assert by_name["tree_15nodes"]["given_params"] == {} and by_name["tree_15nodes"]["status"] == "ok"

    page = (tmp_path / "report.html").read_text()
    overview = page[:page.index("<section")]
    assert "row_intervals" in overview and "rel err" in overview
    assert "same bits batched / packed" in overview and "bitwise" in overview
    assert "position 0 of a batch of 4" in page  # the section lists every layout
    assert {m["invariance"]["layouts"][0]["key"] for m in summary["masks"]} == {"run"}
    assert page.count("<b>captured_scalars</b>") == 1  # said once, above the sections
    assert "Statistics at Lq=1,024 Lk=1,024" in page and "Verification at Lq=512 Lk=512" in page
    assert "Porting spec at Lq=1,024" in page and "Lengths (Lq x Lk): statistics and pictures 1,024 x 1,024" in page
    assert "differs from plain causal attention" in page  # the token view says where it looks and why
    assert "<th></th><th>value</th>" not in page and "<tr>\n      <th>name</th>" not in page
