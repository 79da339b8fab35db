"""bench.ease --merge: parts that each ran one scenario (and some seeds) become one results file; parts of another
experiment (other sizes, settings or backbone) are refused, and no seed/scenario may be counted twice."""

import pytest

from bench.ease import merge


def _row(forget: float, retain: float) -> dict:
    return {"forget_r1": forget, "retain_r1": retain, "bytes_ratio": 0.1, "critical_path_ratio": 0.3, "time_ratio": 0.2}


def _part(scenario: str, seeds: list[int], gap: float, **over) -> dict:
    results = {}
    for s in seeds:
        methods = {"retrain": _row(40.0, 80.0), "ease": _row(40.0 + gap + s, 79.0), "ease_no_excision": _row(55.0, 81)}
        summary = {"forget_r1_gap_pts": gap + s, "forget_r1_signed_gap_pts": gap + s, "retain_r1_drop_pts": 1.0}
        summary |= {"bytes_ratio": 0.1, "critical_path_ratio": 0.3, "in_band": True}
        results[str(s)] = {scenario: {"methods": methods, "summary": summary}}
    part = {
        "sizes": {"seeds": seeds, "rounds": 20},
        "quick": False,
        "ease_config": {"tau": 0.95},
        "backbone": {"sha256": "abc"},
        "seeds": results,
        "run": {"scenarios": [scenario], "wall_seconds": 10.0, "commit": "c0ffee", "loadavg_start": [1, 1, 1]},
    }
    return part | over


def test_parts_merge_into_one_summary():
    report = merge([_part("class", [0, 1], 1.0), _part("client", [0], 2.0), _part("client", [1, 2], 2.0)])
    assert list(report["summary"]) == ["client", "class"]  # the benchmark's order
    client = report["summary"]["client"]
    assert client["seeds"] == 3 and client["forget_r1_gap_pts"] == pytest.approx(3.0)
    assert client["forget_r1_gap_worst_pts"] == 4.0 and client["forget_r1_gap_worst_seed"] == 2
    assert client["methods"]["ease_no_excision"]["forget_r1_gap_pts"] == pytest.approx(15.0)
    assert report["sizes"]["seeds"] == [0, 1, 2] and len(report["parts"]) == 3 and report["wall_seconds"] == 30.0
    assert report["aims"]["class"]["ease"]["forget_r1_gap_pts"]["met"] is True
    assert client["ease"]["forget_r1_gap_pts"] == pytest.approx(3.0) and "ease_fixed" not in client


def test_parts_of_another_experiment_or_twice_the_same_seed_are_refused():
    with pytest.raises(ValueError, match="ease_config"):
        merge([_part("class", [0], 1.0), _part("client", [0], 1.0, ease_config={"tau": 0.9})])
    with pytest.raises(ValueError, match="backbone"):
        merge([_part("class", [0], 1.0), _part("client", [0], 1.0, backbone={"sha256": "other"})])
    with pytest.raises(ValueError, match="sizes"):
        merge([_part("class", [0], 1.0), _part("client", [1], 1.0, sizes={"seeds": [1], "rounds": 10})])
    # what a part ran may differ: its seeds, baselines, ablations, the re-anchoring test
    light = _part("client", [1], 1.0, sizes={"seeds": [1], "rounds": 20, "ablations": False, "relearn_rounds": 0})
    report = merge([_part("client", [0], 1.0, sizes={"seeds": [0], "rounds": 20, "ablations": True}), light])
    assert report["sizes"]["ablations"] == [0] and report["summary"]["client"]["seeds"] == 2
    with pytest.raises(ValueError, match="more than one part"):
        merge([_part("class", [0, 1], 1.0), _part("class", [1], 1.0)])


def test_the_readme_rows_show_every_method_of_every_scenario():
    from bench.ease import rows_markdown

    part = _part("client", [0, 1], 1.0)
    for seed in part["seeds"].values():
        seed["client"]["summary"] |= {"retrain_noise_pts": 2.0, "retrain_noise_retain_pts": 1.0, "n_forget_heldout": 60}
    rows = rows_markdown(merge([part])).splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["ease", "ease_no_excision"]
    assert rows[0].startswith("| client (n = 60 held-out pairs) | ease | 2 | 1.50 [") and "| 2.00 / 1.00 |" in rows[0]
    assert rows[1].endswith("| – / – |")  # no round trips recorded: a dash, not a crash


def test_seeds_that_did_not_search_are_not_counted_out_of_band():
    from bench.ease import in_band

    fixed = _part("samples", [0, 1], 1.0)
    for seed in fixed["seeds"].values():
        seed["samples"]["summary"]["in_band"] = None  # a samples deletion without non-members: no search
    summary = merge([fixed, _part("client", [0, 1], 1.0)])["summary"]
    assert in_band(summary["samples"]) == "no search (fixed scale)"
    assert in_band(summary["client"]) == "2/2 in band"


def test_the_target_level_is_measured_like_every_row_on_the_held_out_pairs():
    """bench.ease.target_level: version 1's forget R@1 on the held-out pairs against the evaluation gallery (what
    |target − retrain|, the floor the target puts under the gap, is computed from); for membership the non-members'
    evaluation half under the current model where it is higher."""
    import dataclasses

    from bench.ease import evaluate, scenario_problem, target_level
    from tests.unit.clip_helpers import tiny_demo

    demo = tiny_demo()
    problem, gallery = scenario_problem(demo, "class")
    model = problem.get_model()
    target = target_level(demo, problem, "class", model, gallery)
    assert target["r1"] == target["version_1_r1"] == evaluate(model, problem.theta_init, problem, gallery)["forget_r1"]
    assert target["nonmember_r1"] is None
    # membership: the non-members' level under the current model counts where it is higher. Here version 1 is made
    # a scrambled model (its LoRA drawn at random, 30× the trained norm), so that the test pairs, retrieved by the
    # trained model, score clearly higher (0.0 against 18.75; with the real LoRA init the two tied at 18.75 on this
    # tiny set once the probe split was stratified)
    import torch

    noise = torch.randn(problem.theta.shape, generator=torch.Generator().manual_seed(0))
    scrambled = dataclasses.replace(problem, theta_init=noise * 30 * problem.theta.norm() / noise.norm())
    with_heldout = dataclasses.replace(demo, data=dataclasses.replace(demo.data, heldout=demo.data.test))
    member = target_level(with_heldout, scrambled, "membership", model, gallery)
    assert member["nonmember_r1"] > member["version_1_r1"] and member["r1"] == member["nonmember_r1"]


def test_results_without_the_gap_split_still_merge_and_print():
    """Result files from before the split (no target_floor_pts / control_transfer_pts / original_retain_drop_pts)
    merge and render; the split's columns show a dash."""
    from bench.ease import markdown_table, print_table

    report = merge([_part("class", [0, 1], 1.0)])
    assert "target_floor_pts" not in report["summary"]["class"]
    table = markdown_table(report)
    assert "| class | 2 |" in table and "\\|target − retrain\\|" in table and "| – | – |" in table
    print_table(report)


def test_the_oracle_row_searches_towards_retrainings_own_probe_level(monkeypatch):
    """bench.ease's ``ease_oracle`` row: EASE's control given retraining's level on the probe split as its target (a
    perfect predictor of retraining's level), and ``probe_transfer_pts`` = |that level − retraining's held-out
    level|: the same model measured on the two splits. Run on the tiny federation's class scenario; every probe
    measurement is recorded (the real ProbeJudge runs), so the level is traced to retraining's θ — on this tiny set
    the original and the retrained model tie on the probe pairs, so the level alone would not tell them apart."""
    import dataclasses

    import torch

    from app.ml.unlearning.base import get_method
    from app.ml.unlearning.ease.method import ProbeJudge
    from app.ml.verification.clip_evidence import split_reference
    from bench.ease import QUICK, run_scenario, scenario_problem
    from tests.unit.clip_helpers import tiny_demo

    measured: list[tuple[torch.Tensor, float, bool, list[str]]] = []
    real_level = ProbeJudge.level

    def recorded(self, theta, pairs=None, stage="probe"):
        level = real_level(self, theta, pairs, stage)
        # what was ranked: the probe pairs (pairs None) against which gallery
        measured.append((theta.detach().clone(), level, pairs is None, list(self.gallery.captions)))
        return level

    monkeypatch.setattr(ProbeJudge, "level", recorded)
    demo = tiny_demo()
    fast = {"excision_steps": 2, "excision_batch": 8, "excision_objective": "uce", "max_probes": 2}
    out = run_scenario(demo, "class", dataclasses.replace(QUICK, baselines=False), fast, lambda msg: None)
    summary, rows = out["summary"], out["methods"]
    problem, _ = scenario_problem(demo, "class")
    retrained = get_method("fed_retrain").build({}).unlearn(problem).theta
    probe_gallery = list(split_reference(demo.data.test)[0].captions)
    on_retrained = [
        (level, probe, gallery)
        for theta, level, probe, gallery in measured
        if torch.allclose(theta, retrained, atol=1e-6)
    ]
    assert on_retrained, "retraining's θ was never measured"
    levels = [level for level, probe, gallery in on_retrained if probe and gallery == probe_gallery]
    assert levels, "retraining's θ was not measured on the probe split against the probe gallery half"
    assert summary["retrain_probe_r1"] == pytest.approx(levels[0], abs=0.01)
    strength = rows["ease_oracle"]["info"]["strength"]
    assert strength["mode"] == "adaptive" and strength["target_r1"] == pytest.approx(levels[0], abs=0.01)
    assert strength["reference_r1"] is None  # version 1 is not the oracle's target
    assert summary["probe_transfer_pts"] == pytest.approx(abs(levels[0] - rows["retrain"]["forget_r1"]), abs=0.01)
    assert summary["oracle_gap_pts"] == round(abs(rows["ease_oracle"]["forget_r1"] - rows["retrain"]["forget_r1"]), 2)


def test_the_interval_of_a_mean_uses_students_t_at_any_number_of_seeds():
    """A merge of two 10-seed parts is a mean over 20: its 95 % interval takes t_{0.975, 19} = 2.093, not the normal
    1.96 (bench.ease's hand table stopped at 10 degrees of freedom and fell back to it)."""
    import math

    from bench.ease import interval

    for n, t in ((10, 2.2622), (20, 2.0930), (31, 2.0423)):
        values = [float(v) for v in range(n)]
        sd = math.sqrt(sum((v - (n - 1) / 2) ** 2 for v in values) / (n - 1))
        low, high = interval(values)["ci95"]
        assert (high - low) / 2 == pytest.approx(t * sd / math.sqrt(n), abs=2e-4)


def test_a_rerun_scenario_supersedes_its_earlier_seeds_and_keeps_its_own_settings():
    """``--supersede``: a scenario rerun after a default changed that only it reads replaces its earlier seeds; each
    scenario's EASE settings are recorded, and one scenario may not mix seeds run under two settings."""
    old = {"tau": 0.95, "holder_excision": "bke"}
    new = {"tau": 0.95, "holder_excision": "auto"}
    before = [_part("client", [0, 1], 1.0, ease_config=old), _part("samples", [0, 1], 5.0, ease_config=old)]
    rerun = _part("samples", [0, 1], 2.0, ease_config=new)
    with pytest.raises(ValueError, match="ease_config"):  # without it, parts of other settings are refused
        merge([*before, rerun])
    report = merge([*before, rerun], supersede=True)
    assert report["summary"]["samples"]["forget_r1_gap_pts"] == pytest.approx(2.5)  # the rerun's seeds only
    assert report["summary"]["client"]["forget_r1_gap_pts"] == pytest.approx(1.5)
    assert report["ease_config_by_scenario"] == {"client": old, "samples": new} and report["ease_config"] == new
    assert {(s["seed"], s["scenario"], s["by"]) for s in report["superseded"]} == {(0, "samples", 2), (1, "samples", 2)}
    with pytest.raises(ValueError, match="mixes seeds"):
        merge([*before, _part("samples", [1], 2.0, ease_config=new)], supersede=True)
    # parts of one setting merge as before: no per-scenario record
    assert "ease_config_by_scenario" not in merge(before, supersede=True)
