"""bench.ease_line: the scale a probe-split control would choose, read off a scanned line, and the rows built from it
(a synthetic scan: no federation is trained)."""

import pytest

from app.ml.unlearning.ease import EaseConfig
from bench.ease_line import GRID, controlled, summarise


def _line(top: float, slope: float, held_offset: float = 0.0) -> list[dict[str, float]]:
    """A falling line: probe level top − slope·s (floored at 0), held-out level offset from it, retained R@1 70 − s."""
    return [
        {
            "scale": s,
            "probe": max(top - slope * s, 0.0),
            "held": max(top - slope * s + held_offset, 0.0),
            "retain": 70 - s,
        }
        for s in GRID
    ]


def test_the_control_lands_in_the_band_on_the_scanned_line():
    line = _line(80.0, 30.0)
    s = controlled(line, 20.0, EaseConfig())
    level = 80.0 - 30.0 * s
    assert 20.0 <= level <= 23.0  # the band [T, T + 3] on the probe split


def test_the_rows_score_the_held_out_split_and_the_oracle_aims_at_retrainings_probe_level():
    """Version 1's probe level 20 and retraining's 35: the version-1 row lands ~15 below retraining (the held-out
    split is 5 points above the probe split for the line and for retraining alike); the oracle row lands on it."""
    seed = {
        "version_1": {"probe": 20.0, "held": 25.0, "retain": 60.0},
        "retrain": {"probe": 35.0, "held": 40.0, "retain": 72.0},
        "retrain_other_order": {"probe": 33.0, "held": 38.0, "retain": 72.0},
        "line": _line(80.0, 30.0, held_offset=5.0),
    }
    summary = summarise({"0": seed}, EaseConfig(target_band=0.0))
    rows = summary["rows"]
    assert rows["oracle_target"]["forget_r1_gap_pts"] == pytest.approx(0.0, abs=0.5)
    assert rows["version_1_target"]["forget_r1_signed_gap_pts"] == pytest.approx(-15.0, abs=0.5)
    assert rows["fixed_0"]["forget_r1_signed_gap_pts"] == pytest.approx(45.0)  # 80 + 5 − 40
    assert rows["fixed_1"]["retain_r1_drop_pts"] == pytest.approx(3.0)  # 72 − (70 − 1)
    assert summary["probe_transfer_pts"] == 5.0 and summary["retrain_noise_pts"] == 2.0
    assert summary["version_1_floor_pts"] == 15.0


def test_sizes_reach_the_federation_and_the_results_file(monkeypatch, tmp_path):
    """``--sizes`` changes bench.ease's Sizes for every seed's federation (here: a spy on scan, no training) and the
    results file records the sizes it ran; an unknown field is refused."""
    import json

    from bench import ease_line

    seen = []
    seed_scan = {
        "version_1": {"probe": 20.0, "held": 25.0, "retain": 60.0},
        "retrain": {"probe": 35.0, "held": 40.0, "retain": 72.0},
        "retrain_other_order": {"probe": 33.0, "held": 38.0, "retain": 72.0},
        "line": _line(80.0, 30.0),
    }

    def scan(seed, scenario, sizes, settings, cache_dir, grid):
        seen.append(sizes)
        return seed_scan

    monkeypatch.setattr(ease_line, "scan", scan)
    monkeypatch.setattr(ease_line, "pretrain_tiny_clip", lambda **_: None)
    out = tmp_path / "line.json"
    big = ["--seeds", "0,1", "--sizes", '{"n_test": 900, "pairs_per_client": 400}', "--tag", "big"]
    ease_line.main([*big, "--out", str(out)])
    assert [(s.n_test, s.pairs_per_client) for s in seen] == [(900, 400)] * 2
    assert json.loads(out.read_text())["sizes"]["n_test"] == 900
    for sizes in ('{"n_tests": 900}', '{"seeds": [0]}', '{"n_test": "900"}', "[900]"):  # unknown, unread, type
        with pytest.raises(SystemExit):
            ease_line.main(["--seeds", "0", "--sizes", sizes, "--tag", "x", "--out", str(out)])
    with pytest.raises(SystemExit):  # another size may not overwrite the default-size results file
        ease_line.main(["--seeds", "0", "--sizes", '{"n_test": 900}', "--out", str(out)])
    assert len(seen) == 2


def test_a_finer_grid_reaches_the_scan_the_rows_and_the_results_file(monkeypatch, tmp_path):
    """``--grid`` sets the scales every seed's line is measured at (a spy on scan), a fixed row per scale, and the
    results file records it; a grid not from 0 or not ascending, or without --tag, is refused."""
    import json

    from bench import ease_line

    grids = []

    def scan(seed, scenario, sizes, settings, cache_dir, grid):
        grids.append(grid)
        line = [{"scale": s, "probe": 80 - 30 * s, "held": 80 - 30 * s, "retain": 70 - s} for s in grid]
        retrain = {"probe": 35.0, "held": 40.0, "retain": 72.0}
        return {"version_1": retrain, "retrain": retrain, "retrain_other_order": retrain, "line": line}

    monkeypatch.setattr(ease_line, "scan", scan)
    monkeypatch.setattr(ease_line, "pretrain_tiny_clip", lambda **_: None)
    out = tmp_path / "line.json"
    ease_line.main(["--seeds", "0,1", "--grid", "0,0.5,0.7,1", "--tag", "fine", "--out", str(out)])
    assert grids == [(0.0, 0.5, 0.7, 1.0)] * 2
    report = json.loads(out.read_text())
    assert report["grid"] == [0.0, 0.5, 0.7, 1.0]
    assert report["summary"]["rows"]["fixed_0.7"]["forget_r1_signed_gap_pts"] == pytest.approx(80 - 21 - 40)
    assert "fixed_1.25" not in report["summary"]["rows"]
    bad_grids = (
        ["--grid", "0.5,1", "--tag", "x"],
        ["--grid", "0,1,0.7", "--tag", "x"],
        ["--grid", "0,0.7,1"],
        ["--grid", "0,a", "--tag", "x"],
    )
    for bad in bad_grids:
        with pytest.raises(SystemExit):
            ease_line.main(["--seeds", "0", *bad, "--out", str(out)])
    assert len(grids) == 2
