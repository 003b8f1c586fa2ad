"""Cells of several training tracks (data~multi_hop, data~single_hop) form one table row."""

import json

import pytest

from a2tgpo.report import ReportInputError, discover_cells, merge_tracks, split_tracks


def _cell(runs, track, datasets, seed=1):
    cell = runs / "backbone~b" / f"data~{track}" / "method~grpo" / "beta~0" / f"seed~{seed}"
    (cell / "eval").mkdir(parents=True)
    groups = {}
    for _name, (n, em, group) in datasets.items():
        g = groups.setdefault(group, {"n": 0, "em": 0.0, "f1": 0.0})
        g["em"] = (g["em"] * g["n"] + em * n) / (g["n"] + n)
        g["f1"] = g["em"]
        g["n"] += n
    all_n = sum(n for n, _, _ in datasets.values())
    groups["all"] = {"n": all_n, "em": 0.0, "f1": 0.0}  # replaced by the merge
    (cell / "eval" / "summary.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM",
        "datasets": {k: {"n": n, "em": em, "f1": em, "group": g}
                     for k, (n, em, g) in datasets.items()},
        "groups": groups}))
    return cell


def test_track_cells_merge_into_one_row(tmp_path):
    runs = tmp_path / "runs"
    _cell(runs, "multi_hop", {"hotpotqa": (100, 0.5, "multi_hop"),
                              "bamboogle": (25, 0.2, "multi_hop")})
    _cell(runs, "single_hop", {"nq": (75, 0.4, "single_hop")})
    cells = discover_cells(runs)
    assert sorted(c.data for c in cells) == ["multi_hop", "single_hop"]
    (row,) = merge_tracks(cells)
    s = row.summary()
    assert sorted(s["datasets"]) == ["bamboogle", "hotpotqa", "nq"]
    # multi-hop group kept from its track: (100·0.5 + 25·0.2) / 125 = 55 / 125 = 0.44
    assert s["groups"]["multi_hop"]["em"] == pytest.approx(0.44)
    assert s["groups"]["single_hop"]["em"] == pytest.approx(0.4)
    # overall, sample-weighted over both tracks: (50 + 5 + 30) / 200 = 0.425
    assert s["groups"]["all"] == {"n": 200, "em": pytest.approx(0.425),
                                  "f1": pytest.approx(0.425)}
    # plots keep the tracks apart
    assert sorted(c.backbone for c in split_tracks(cells)) == ["b/multi_hop", "b/single_hop"]


def test_a_dataset_in_two_tracks_is_an_error(tmp_path):
    runs = tmp_path / "runs"
    _cell(runs, "multi_hop", {"hotpotqa": (10, 0.5, "multi_hop")})
    _cell(runs, "single_hop", {"hotpotqa": (10, 0.1, "multi_hop")})
    with pytest.raises(ReportInputError, match="hotpotqa is also evaluated by another track"):
        merge_tracks(discover_cells(runs))


def test_cells_of_two_regimes_do_not_share_a_report(tmp_path):
    # runs/backbone~b/regime~long/... trained the same coordinates under other settings: one
    # table row cannot stand for both
    runs = tmp_path / "runs"
    plain = _cell(runs, "multi_hop", {"hotpotqa": (10, 0.5, "multi_hop")})
    long = runs / "backbone~b" / "regime~long" / plain.relative_to(runs / "backbone~b")
    long.parent.mkdir(parents=True)
    plain.rename(long)
    (cell,) = discover_cells(runs)
    assert (cell.regime, cell.data) == ("long", "multi_hop")
    _cell(runs, "multi_hop", {"hotpotqa": (10, 0.4, "multi_hop")})
    with pytest.raises(ReportInputError, match=r"several training regimes \(\(none\), long\)"):
        discover_cells(runs)
    # each regime on its own is fine
    assert [c.regime for c in discover_cells(cells=[long])] == ["long"]
