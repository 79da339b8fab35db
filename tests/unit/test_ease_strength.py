import math

import pytest

from app.ml.unlearning.base import get_method
from app.ml.unlearning.ease.strength import search_scale

from .clip_helpers import tiny_demo


def cliff(centre: float, width: float = 0.2, top: float = 80.0, bottom: float = 5.0):
    """A monotone cliff like the measured response (s = 0.25 … 1.25 → 79 … 6 points: centre ≈ 0.7, width ≈ 0.2 of
    the centre), with a call log."""
    calls: list[float] = []

    def response(s: float) -> float:
        calls.append(s)
        return bottom + (top - bottom) / (1 + math.exp((s - centre) / (width * centre)))

    return response, calls


@pytest.mark.parametrize("centre", [0.5, 0.75, 1.0, 1.6])
@pytest.mark.parametrize("target", [15.0, 22.0, 40.0])
def test_search_stops_in_the_band_within_the_probe_budget(centre, target):
    response, calls = cliff(centre)
    result = search_scale(response, target, 3.0, start=1.0, scale_max=8.0, max_probes=5)
    assert result.in_band and target <= result.level <= target + 3.0
    assert len(result.probes) == len(calls) <= 5  # every evaluation is a published probe
    assert result.probes[-1] == (result.scale, result.level)  # it stops at the first probe in the band


def test_search_lands_in_the_band_on_most_cliffs():
    """Over a wider grid (steeper and flatter cliffs, far centres) the budget of 5 probes reaches the band in ≥ 85 %
    of cases; the rest end on the probe nearest to the band (the measured rate is what EaseConfig's docstring cites)."""
    hits = total = 0
    for width in (0.1, 0.2, 0.3):
        for centre in (0.5, 0.75, 1.0, 1.6, 2.5):
            for target in (12.0, 15.0, 22.0, 30.0, 40.0, 55.0):
                response, _ = cliff(centre, width)
                result = search_scale(response, target, 3.0, start=1.0, max_probes=5)
                hits += result.in_band
                total += 1
    assert hits / total >= 0.85


def test_search_moves_the_right_way_on_a_monotone_response():
    # too weak at the start → larger scales; too strong → smaller ones
    response, calls = cliff(3.0)
    search_scale(response, 20.0, 3.0, start=1.0, max_probes=4)
    assert calls[1] > calls[0]
    response, calls = cliff(0.3)
    search_scale(response, 20.0, 3.0, start=1.0, max_probes=4)
    assert calls[1] < calls[0]


def test_unreachable_band_picks_the_nearest_probe_and_says_why():
    response, calls = cliff(20.0)  # even scale_max barely forgets
    result = search_scale(response, 10.0, 3.0, start=1.0, scale_max=4.0, max_probes=6)
    assert not result.in_band and "scale_max" in result.reason
    assert result.scale == 4.0 and len(calls) == 3  # 1 → 2 → 4, then it stops (the strongest probe is chosen)
    # a band between two probes that a step response jumps over: the probe nearest to the band, at or above it
    result = search_scale(lambda s: 80.0 if s < 1.2 else 5.0, 60.0, 3.0, start=1.0, max_probes=4)
    assert not result.in_band and result.level == 80.0 and len(result.probes) == 4


def test_known_levels_bracket_without_costing_a_probe():
    response, calls = cliff(1.0)
    result = search_scale(response, 40.0, 3.0, start=1.0, max_probes=3, known={0.0: 80.0})
    assert all(s > 0 for s in calls) and len(result.probes) == len(calls)


def test_bad_arguments():
    with pytest.raises(ValueError):
        search_scale(lambda s: 0.0, 1.0, -1.0)
    with pytest.raises(ValueError):
        search_scale(lambda s: 0.0, 1.0, 1.0, max_probes=0)


def test_ease_publishes_target_scale_and_probes_and_counts_them():
    demo = tiny_demo()
    problem = demo.problem("client")
    # the uce objective always pushes (the tiny demo's barely-trained backbone leaves "reference" nothing to undo)
    settings = {
        "excision_steps": 3,
        "excision_batch": 8,
        "excision_lr": 0.05,
        "excision_objective": "uce",
        "max_probes": 3,
        "client_excision": "bke",  # client scope's default excision is the server's, with no probes
    }
    result = get_method("ease").build(settings).unlearn(problem)
    strength = result.info["strength"]
    assert strength["mode"] == "adaptive" and 1 <= len(strength["probes"]) <= 3
    assert strength["target_r1"] == strength["reference_r1"]  # the concept demo has no matched non-members
    chosen = [p for p in strength["probes"] if p["scale"] == strength["scale"]]
    assert chosen and chosen[0]["r1"] == pytest.approx(strength["level_r1"], abs=1e-3)
    assert strength["in_band"] == (strength["target_r1"] <= strength["level_r1"] <= strength["target_r1"] + 3.0)
    # every probe (and the target's evaluation) is a stage of the ledger, with its forwards and its bytes
    probe_stages = [s for s in result.info["stages"] if s["stage"] == "probe"]
    assert len(probe_stages) == len(strength["probes"]) and all(s["pair_forwards"] > 0 for s in probe_stages)
    assert result.info["bytes_by_item"]["up"]["probes: forget-pair embeddings"] > 0
    assert result.info["critical_seconds"] <= result.info["compute_seconds"] + 1e-9


def test_a_samples_deletion_without_non_members_runs_at_the_fixed_scale():
    """Issue 24 item 3: version 1's level does not predict retraining's for a data subject's pairs, so under
    ``target="auto"`` a samples deletion with BKE at its holder (the default of one holder's deletion is the stored
    share since stop 53: test_ease_method) searches only where matched non-members give it a level."""
    from app.ml.unlearning.ease.method import NO_TARGET_REASON

    demo = tiny_demo()
    fast = {"excision_steps": 2, "excision_batch": 8, "excision_objective": "uce", "max_probes": 2}
    fast["holder_excision"] = "bke"
    ease = get_method("ease").build(fast)
    alone = ease.unlearn(demo.problem("samples"))
    strength = alone.info["strength"]
    assert strength["mode"] == "fixed" and strength["reason"] == NO_TARGET_REASON
    assert strength["probes"] == [] and strength["scale"] == 1.0
    assert not [s for s in alone.info["stages"] if s["stage"] == "probe"]
    assert "probes: forget-pair embeddings" not in alone.info["bytes_by_item"]["up"]
    # matched non-members give the search its level; "reference" asks for version 1's explicitly
    matched = ease.unlearn(demo.problem("samples", nonmembers=demo.data.test)).info["strength"]
    assert matched["mode"] == "adaptive" and matched["nonmember_r1"] is not None and matched["probes"]
    asked = get_method("ease").build({**fast, "target": "reference"}).unlearn(demo.problem("samples"))
    assert asked.info["strength"]["mode"] == "adaptive" and asked.info["strength"]["probes"]


def test_an_explicit_target_level_is_searched_towards_in_every_scope():
    """``target_r1`` (the benchmark's oracle row: retraining's own probe level) replaces the measured target, and a
    samples deletion without non-members searches when given one (with BKE at its holder: the stored share searches
    nothing); version 1 is then not evaluated at all."""
    demo = tiny_demo()
    fast = {"excision_steps": 2, "excision_batch": 8, "excision_objective": "uce", "max_probes": 2}
    fast["holder_excision"] = "bke"
    for scope in ("class", "samples"):
        info = get_method("ease").build({**fast, "target_r1": 12.5}).unlearn(demo.problem(scope)).info
        strength = info["strength"]
        assert strength["mode"] == "adaptive" and strength["probes"]
        assert strength["target_r1"] == 12.5 and strength["reference_r1"] is None
        assert not [s for s in info["stages"] if s["stage"].startswith("target:")]
    with pytest.raises(ValueError, match="target_r1"):
        get_method("ease").build({"target_r1": 140.0})
    with pytest.raises(ValueError, match="target_r1"):  # an explicit level and a measured one: which?
        get_method("ease").build({"target_r1": 10.0, "target": "reference"})


def test_a_memorisation_deletion_runs_the_longer_excision_and_more_repair_rounds():
    """EaseConfig's memorisation settings: a samples deletion with matched non-members runs BKE for
    ``memorisation_excision_steps`` and ``memorisation_repair_rounds`` rounds; one without them runs the general
    settings, and a class deletion the general excision with ``class_repair_rounds`` rounds."""
    demo = tiny_demo()
    fast = {
        "excision_batch": 8,
        "max_probes": 1,
        "memorisation_excision_steps": 4,
        "memorisation_repair_rounds": 2,
        "class_repair_rounds": 3,
        "holder_excision": "bke",  # a one-holder samples deletion's default is the stored share (test_ease_method)
    }
    ease = get_method("ease").build(fast)

    def rounds(info):  # the protected repair rounds the ledger counted
        return sum(1 for s in info["stages"] if s["stage"].startswith("repair round"))

    matched = ease.unlearn(demo.problem("samples", nonmembers=demo.data.test)).info
    assert matched["memorisation"] and matched["excision_steps"] == 4 and matched["repair_rounds"] == 2
    assert {b["steps"] for b in matched["bke"]} == {4} and rounds(matched) == 2
    for problem, n in ((demo.problem("samples"), 1), (demo.problem("class"), 3)):
        info = ease.unlearn(problem).info
        assert not info["memorisation"] and info["excision_steps"] == 6 and info["repair_rounds"] == n
        assert {b["steps"] for b in info["bke"]} == {6} and rounds(info) == n
    # unset, a class deletion runs ``repair_rounds`` (a model registered before the setting keeps its rounds)
    info = (
        get_method("ease")
        .build({**fast, "class_repair_rounds": None, "repair_rounds": 2})
        .unlearn(demo.problem("class"))
    )
    assert rounds(info.info) == 2
    with pytest.raises(ValueError, match="class_repair_rounds"):
        get_method("ease").build({"class_repair_rounds": -1})


def test_replayed_bases_travel_as_float16_and_the_server_decomposes_what_was_sent(monkeypatch):
    """GSD in class scope: every basis a client uploads is counted at 2 bytes an entry, and the decomposition the
    server runs receives exactly those rounded entries (method.BASIS_DTYPE), so the bytes are what was sent."""
    import torch

    from app.ml.federation.accounting import Ledger
    from app.ml.unlearning.ease import method
    from app.ml.unlearning.ease.method import EaseConfig, decompose

    seen = {}
    real = method.blockwise_exclusive

    def spy(forget, retain, *args, **kwargs):
        seen["forget"], seen["retain"] = forget, retain
        return real(forget, retain, *args, **kwargs)

    demo = tiny_demo()
    problem = demo.problem("class")
    cfg = EaseConfig(gsd_space="gradient")
    with monkeypatch.context() as m:  # sent at full precision: the angles the rounding may not move
        m.setattr(method, "BASIS_DTYPE", torch.float32)
        exact = decompose(problem, cfg, problem.get_model(), Ledger()).info
    monkeypatch.setattr(method, "blockwise_exclusive", spy)
    ledger = Ledger()
    info = decompose(problem, cfg, problem.get_model(), ledger).info
    assert info["rank_exclusive"] == exact["rank_exclusive"] and info["rank_forget"] == exact["rank_forget"]
    assert info["angles_deg"] == pytest.approx(exact["angles_deg"], abs=0.1)  # hundredths of a degree, not tenths
    up = dict(ledger.bytes_up)
    for key in ("forget", "retain"):
        bases = [b for src in seen[key] for b in src]
        assert bases and all(torch.equal(b, b.half().to(b.dtype)) for b in bases)  # rounded as sent
        assert any(b.dtype != torch.float16 and b.numel() for b in bases)
    entries = sum(int(b.numel()) for src in seen["forget"] for b in src)
    assert up["GSD: holders' forget bases"] == 2 * entries
    retained = sum(int(b.numel()) for src in seen["retain"] for b in src)
    assert up["GSD: retain bases"] + up.get("GSD: other clients' retain bases", 0) == 2 * retained

    # what stays on the server is neither rounded nor counted: the stored updates lent in the "mixed" space (the
    # non-holders' retain bases, after the holders' own) and every basis of a client deletion
    ledger = Ledger()
    decompose(problem, EaseConfig(gsd_space="mixed"), problem.get_model(), ledger)
    lent = seen["retain"][len(problem.holders()) :]
    assert lent and all(not torch.equal(b, b.half().to(b.dtype)) for src in lent for b in src if b.numel())
    assert "GSD: other clients' retain bases" not in ledger.bytes_up
    ledger = Ledger()
    decompose(demo.problem("client"), EaseConfig(), problem.get_model(), ledger)
    assert seen["forget"] and not any(k.startswith("GSD") for k in [*ledger.bytes_up, *ledger.bytes_down])


def test_lock_gsd_off_locks_only_the_excision_direction():
    """``lock_gsd=False``: the lock holds the excision direction alone, so the protected repair round may move along
    U_μ; by default it holds U_μ and the excision direction, and the repair round stays out of U_μ."""
    import torch

    from app.ml.federation.accounting import Ledger
    from app.ml.unlearning.ease.method import Ease, EaseConfig

    demo = tiny_demo()
    fast = {"excision_steps": 2, "excision_batch": 8, "excision_objective": "uce", "max_probes": 1}
    on = Ease(EaseConfig(**fast)).line(demo.problem("class"), Ledger())
    off = Ease(EaseConfig(**fast, lock_gsd=False)).line(demo.problem("class"), Ledger())
    u_mu = off.subspaces.u_mu.float()
    assert u_mu.shape[1] > 0 and on.lock.rank == u_mu.shape[1] + 1 and off.lock.rank == 1
    unit = off.excision / off.excision.norm()
    assert abs(float(off.lock.basis[:, 0] @ unit)) == pytest.approx(1.0, abs=1e-4)  # the one locked direction is E
    # the repair round: locked out of U_μ by default, free to move along it when lock_gsd is off
    assert float(torch.linalg.norm(u_mu.T @ on.repair)) < 1e-4 * float(on.repair.norm()) + 1e-7
    assert float(torch.linalg.norm(u_mu.T @ off.repair)) > 1e-2 * float(off.repair.norm())
    info = get_method("ease").build({**fast, "lock_gsd": False}).unlearn(demo.problem("class")).info
    assert info["lock_rank"] == 1
