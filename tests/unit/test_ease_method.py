import dataclasses

import numpy as np
import pytest
import torch

from app.ml.unlearning.base import InvalidMethodSettingsError, available_methods, get_method
from app.ml.unlearning.ease import EaseConfig, ForgetLock
from app.ml.unlearning.ease.excision import bilateral_excision, concept_words, excision_loss, without_words

from .clip_helpers import tiny_demo

FAST = {"excision_steps": 2, "excision_batch": 8, "replay_points": 2, "repair_rounds": 1}


def test_registry_exposes_ease_and_the_federated_baselines():
    names = {s.name for s in available_methods(model_kind="clip_federated")}
    assert {"ease", "fed_retrain", "fed_gradient_ascent", "federaser", "fedosd"} <= names
    spec = get_method("ease")
    assert spec.scopes == {"client", "class", "samples"}
    with pytest.raises(InvalidMethodSettingsError):
        spec.build({"no_such_setting": 1})
    with pytest.raises(InvalidMethodSettingsError):
        spec.build({"excision_towers": ["audio"]})


@pytest.mark.parametrize("scope", ["client", "class", "samples"])
def test_ease_unlearns_each_scope_and_returns_a_lock(scope):
    demo = tiny_demo()
    problem = demo.problem(scope)
    calls = []
    problem.progress = lambda f, m: calls.append(f)
    result = get_method("ease").build(FAST).unlearn(problem)
    assert result.theta.shape == demo.theta.shape and torch.isfinite(result.theta).all()
    assert not torch.equal(result.theta, demo.theta)
    lock = ForgetLock.from_bytes(result.artifacts["forget_lock"])
    assert torch.equal(lock.theta_unl, result.theta)
    assert result.info["gsd"]["rank_exclusive"] <= result.info["gsd"]["rank_forget"]
    assert result.info["bytes_total"] > 0 and calls[-1] == 1.0
    # the unlearned model is not displaced along the exclusive directions relative to the lock anchor
    assert lock.drift(result.theta) == pytest.approx(0.0, abs=1e-6)


def test_one_sided_excision_leaves_the_other_tower_alone():
    demo = tiny_demo()
    model = demo.model
    forget = demo.problem("client").forget_data()
    out, _ = bilateral_excision(
        model,
        demo.theta,
        forget,
        steps=2,
        batch_size=8,
        towers=("text",),
        objective="reference",
        reference_theta=demo.theta_init,
        lr=0.05,
    )
    moved = (out - demo.theta).abs() > 0
    assert moved[model.tower_mask("text")].any() and not moved[model.tower_mask("image")].any()


def test_retain_negatives_and_anchor_path_runs():
    demo = tiny_demo()
    problem = demo.problem("class")
    k = problem.holders()[0]
    out, info = bilateral_excision(
        demo.model,
        demo.theta,
        problem.forget_data(k),
        steps=2,
        batch_size=8,
        objective="reference",
        reference_theta=demo.theta_init,
        retain=problem.retain_data(k),
        anchor_weight=1.0,
        lr=0.05,
    )
    assert info["steps"] == 2 and torch.isfinite(out).all() and not torch.equal(out, demo.theta)


def test_excision_objectives_are_bounded():
    torch.manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    labels = torch.arange(8)
    uce = excision_loss(img, img, torch.tensor(100.0), labels, "uce")
    assert 0 <= float(uce) <= np.log(2) + 1e-6
    hinge = excision_loss(img, img, torch.tensor(100.0), labels, "hinge", margin=0.1)
    assert float(hinge) >= 0
    # the reference objective is zero when the model matches no better than the reference, positive otherwise
    other = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    ref = (other, other.roll(1, dims=0), torch.tensor(20.0))
    assert float(excision_loss(other, other.roll(1, dims=0), torch.tensor(20.0), labels, "reference", ref=ref)) < 1e-5
    assert float(excision_loss(img, img, torch.tensor(20.0), labels, "reference", ref=ref)) > 0


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("fed_retrain", {"rounds": 1}),
        ("fed_gradient_ascent", {"steps": 2, "post_rounds": 1}),
        ("federaser", {"interval": 1}),
        ("fedosd", {"rounds": 1, "post_rounds": 1}),
    ],
)
def test_baselines_run(name, settings):
    demo = tiny_demo()
    for scope in ("client", "class"):
        result = get_method(name).build(settings).unlearn(demo.problem(scope))
        assert torch.isfinite(result.theta).all() and result.info["bytes_total"] > 0


def test_config_validation():
    with pytest.raises(ValueError):
        EaseConfig(delta_deg=120)
    with pytest.raises(ValueError):
        EaseConfig(gsd="partial")


@pytest.mark.parametrize(
    ("settings", "leaving_client"),
    [({}, "online"), ({"leaving_client": "offline"}, "offline")],
    ids=["default", "offline"],
)
def test_a_client_deletion_runs_from_the_stored_updates_alone(settings, leaving_client):
    """Client scope by default, and always when the leaving client is offline: no step reads the leaving client's
    pairs — the excision is its stored FedAvg share, the strength is not probed — and the result still moves off the
    original and is locked (method.py, EaseConfig ``client_excision``)."""
    demo = tiny_demo()
    problem = demo.problem("client")
    leaving = int(problem.forget_client)
    read = []
    original = type(problem).forget_data

    def forget_data(self, *args, **kwargs):
        read.append(args)
        return original(self, *args, **kwargs)

    problem.forget_data = forget_data.__get__(problem)
    result = get_method("ease").build({**FAST, **settings}).unlearn(problem)
    assert read == [], "the leaving client's pairs were read"
    info = result.info
    assert info["leaving_client"] == leaving_client and info["client_excision"] == "stored_updates"
    assert info["strength"]["mode"] == "stored_updates"
    assert info["strength"]["probes"] == [] and info["pair_grads"] > 0  # the repair rounds, at retained clients only
    assert info["bke"][0]["client"] == leaving and info["bke"][0]["pair_grads"] == 0
    assert not any("BKE" in item or "probes" in item for side in info["bytes_by_item"].values() for item in side)
    lock = ForgetLock.from_bytes(result.artifacts["forget_lock"])
    assert lock.drift(result.theta) == pytest.approx(0.0, abs=1e-6)
    assert float((result.theta - demo.theta).norm()) > 0
    # an offline holder on a class deletion is refused: its holders' pairs are indispensable there
    with pytest.raises(ValueError, match="client scope only"):
        get_method("ease").build({**FAST, "leaving_client": "offline"}).unlearn(demo.problem("class"))


def test_the_server_excision_is_minus_the_leaving_clients_stored_share_off_the_exclusive_subspace():
    """method.py server_excision: E = −(I − U_μU_μᵀ)·share, share = the leaving client's FedAvg-weighted updates."""
    from app.ml.federation.accounting import Ledger
    from app.ml.unlearning.ease.method import Ease, forget_contribution

    problem = tiny_demo().problem("client")
    line = Ease(EaseConfig(**FAST)).line(problem, Ledger())
    share = forget_contribution(problem).double()
    u = line.subspaces.u_mu.double()
    expected = -(share - u @ (u.T @ share))
    assert float(expected.norm()) > 0
    assert torch.allclose(line.excision.double(), expected, atol=1e-6 * float(expected.norm()))
    assert line.scale0 == EaseConfig().offline_scale


def test_client_excision_bke_runs_bke_at_the_leaving_client():
    """``client_excision="bke"``: the leaving client takes part — BKE on its pairs, the strength searched on probes."""
    demo = tiny_demo()
    problem = demo.problem("client")
    bke = {**FAST, "client_excision": "bke", "max_probes": 2, "excision_objective": "uce", "excision_lr": 0.05}
    result = get_method("ease").build(bke).unlearn(problem)
    info = result.info
    assert info["client_excision"] == "bke" and info["strength"]["mode"] == "adaptive"
    assert info["bke"][0]["client"] == int(problem.forget_client) and info["bke"][0]["pair_grads"] > 0
    assert info["strength"]["probes"] and any("BKE" in item for item in info["bytes_by_item"]["up"])
    # an offline leaving client overrides it: there is no one to run BKE
    offline = {**FAST, "client_excision": "bke", "leaving_client": "offline"}
    assert get_method("ease").build(offline).unlearn(demo.problem("client")).info["client_excision"] == "stored_updates"


def test_gsd_compares_one_update_space_block_by_block():
    """Issue 24 item 3: with ``gsd_space="gradient"`` every retained client's support in class scope comes from
    gradients at the replayed models (the clients without forget pairs replay too — no stored Adam update against
    raw gradients), and with ``gsd_blocks="tensor"`` the subspaces are built per LoRA tensor (every direction lives
    in one A or one B). The default ``"mixed"`` keeps the stored updates of the clients without forget pairs and
    sends them nothing."""
    from app.ml.clip import lora_layout
    from app.ml.federation.accounting import Ledger
    from app.ml.unlearning.ease.method import decompose

    demo = tiny_demo()
    problem = demo.problem("class")
    others = [k for k in range(problem.n_clients) if k not in problem.holders()]
    assert others, "the test federation has clients without forget pairs"
    layout = lora_layout(demo.model.model)
    read = []
    original = type(problem).client_history

    def client_history(self, k):
        read.append(k)
        return original(self, k)

    problem.client_history = client_history.__get__(problem)
    ledger = Ledger()
    sub = decompose(problem, EaseConfig(**FAST, gsd_blocks="tensor", gsd_space="gradient"), demo.model, ledger)
    assert read == [], "a stored (Adam-normalised) update entered the class-scope decomposition"
    up = ledger.to_info()["bytes_by_item"]["up"]
    assert up.get("GSD: other clients' retain bases", 0) > 0
    assert sub.info["blocks"] == len(layout) and sub.info["space"] == "gradient"
    # every direction of U_f, Q_r and U_μ lies inside one LoRA tensor
    for basis in (sub.u_f, sub.q_r, sub.u_mu):
        for col in basis.T:
            touched = {
                i
                for i, t in enumerate(layout)
                if col[t["offset"] : t["offset"] + t["shape"][0] * t["shape"][1]].abs().max() > 0
            }
            assert len(touched) == 1
    flat = decompose(problem, EaseConfig(**FAST, gsd_space="gradient"), demo.model, Ledger())
    assert read == [] and flat.info["blocks"] == 1 and flat.info["space"] == "gradient"
    mixed = decompose(problem, EaseConfig(**FAST), demo.model, Ledger())  # the default: the earlier mixed space
    assert sorted(set(read)) == others and mixed.info["space"] == "mixed"
    with pytest.raises(ValueError):
        EaseConfig(gsd_blocks="rows")
    with pytest.raises(ValueError):
        EaseConfig(gsd_space="adam")


def test_repair_round_is_rerun_at_a_scale_far_from_its_own(monkeypatch):
    """Issue 24 item 3 (the class scenario's scale): Δ_rep is computed at the first probe's scale s₀; when the search
    settles far from it the repair round is rerun at the chosen scale (a counted round) and the search continues on
    that line, so the published model is repaired where it is published. Off, the published model keeps Δ_rep(s₀).
    The first search is made to settle at 3 × s₀ (the tiny federation's target is met anywhere)."""
    import app.ml.unlearning.ease.method as ease_method
    from app.ml.federation.accounting import Ledger
    from app.ml.unlearning.ease import Ease
    from app.ml.unlearning.ease.strength import ScaleSearch

    real = ease_method.search_scale
    calls = []

    def search(response, target, band, **kw):
        calls.append(kw["start"])
        if len(calls) == 1:
            level = response(3.0)
            return ScaleSearch(3.0, level, target, band, [(3.0, level)], False, "forced")
        return real(response, target, band, **kw)

    monkeypatch.setattr(ease_method, "search_scale", search)
    demo = tiny_demo()
    problem = demo.problem("class")
    result = get_method("ease").build({**FAST, "repair_at_scale": True}).unlearn(problem)
    info = result.info
    assert calls == [1.0, 3.0]
    assert info["strength"]["rescaled"]["repair_scale"] == 3.0
    assert any("(rescaled)" in item for item in info["bytes_by_item"]["up"])
    # the published model is θ_p + s·E + Δ_rep(3), not θ_p + s·E + Δ_rep(1)
    ease = Ease(EaseConfig(**FAST, repair_at_scale=True))
    line = ease.line(problem, Ledger())
    s = info["strength"]["scale"]
    rep3 = ease.repair(problem, line.theta_p, line.excision, line.lock, 3.0, Ledger())
    assert torch.allclose(result.theta, line.theta_p + s * line.excision + rep3, atol=1e-6)
    assert not torch.allclose(rep3, line.repair, atol=1e-6)
    calls.clear()
    off = get_method("ease").build(FAST).unlearn(problem)  # the default: no rerun
    assert calls == [1.0] and "rescaled" not in off.info["strength"]
    assert torch.allclose(off.theta, line.at(3.0), atol=1e-6)
    assert off.info["client_round_trips"] < info["client_round_trips"]


def test_a_class_or_samples_deletion_projects_off_the_whole_forget_subspace():
    """EaseConfig ``replay_gsd="whole"``: a class deletion and a samples deletion without matched non-members project
    off all of U_f (a class's gradients share directions with the retained pairs', so the exclusive part left most of
    it to the scaled excision); client scope and memorisation deletions keep ``gsd`` (the retain-exclusive part)."""
    demo = tiny_demo()
    bke = {**FAST, "memorisation_excision_steps": 2, "max_probes": 1, "holder_excision": "bke"}
    ease = get_method("ease").build(bke)
    for scope in ("class", "samples"):
        info = ease.unlearn(demo.problem(scope)).info
        assert info["gsd_projection"] == "whole", scope
        assert info["gsd"]["rank_exclusive"] == info["gsd"]["rank_forget"] > 0, scope
    for problem in (demo.problem("client"), demo.problem("samples", nonmembers=demo.data.test)):
        assert ease.unlearn(problem).info["gsd_projection"] == "exclusive", problem.scope
    asked = get_method("ease").build({**FAST, "replay_gsd": "exclusive"}).unlearn(demo.problem("class")).info
    assert asked["gsd_projection"] == "exclusive" and asked["gsd"]["rank_exclusive"] <= asked["gsd"]["rank_forget"]


def test_a_local_update_replays_its_round_bit_for_bit_and_drops_only_the_marked_pairs():
    """Federation.local_update: at the rebuilt θ_t with round index t a holder's stored update comes back exactly
    (the replayed share uses the stored update as the 'with' side); ``drop`` with nothing marked changes nothing, and
    with the forget pairs marked it trains on the same batches without them (a different update)."""
    from app.ml.federation import Federation, trajectory

    problem = tiny_demo().problem("class")
    fed = Federation(problem.get_model(), problem.clients, problem.fed_settings)
    thetas = trajectory(problem.theta_init, problem.full_history(), problem.weights)
    k = problem.holders()[0]
    for r in range(int(problem.n_rounds)):
        stored = problem.client_history(k)[r]
        assert torch.equal(fed.local_update(thetas[r], k, round_index=r), stored)
        nothing = torch.zeros(len(problem.clients[k]), dtype=torch.bool)
        assert torch.equal(fed.local_update(thetas[r], k, round_index=r, drop=nothing), stored)
        without = fed.local_update(thetas[r], k, round_index=r, drop=torch.as_tensor(problem.forget_masks[k]))
        assert float((without - stored).norm()) > 1e-3 * float(stored.norm())


def test_the_replayed_share_is_the_stored_updates_minus_the_counterfactual_without_the_forget_pairs():
    """share.py: Σ_k Σ_t (w_k / Σ_present w)(Δ_k,t − Δ_k,t(drop)), every round replayed (or R / points of them);
    ``holder_excision="replayed_share"`` takes minus it, off U_μ, instead of running BKE."""
    from app.ml.federation import Federation, trajectory
    from app.ml.federation.accounting import Ledger
    from app.ml.unlearning.ease.method import Ease
    from app.ml.unlearning.ease.share import replayed_share, share_rounds

    problem = tiny_demo().problem("class")
    model = problem.get_model()
    fed = Federation(model, problem.clients, problem.fed_settings)
    thetas = trajectory(problem.theta_init, problem.full_history(), problem.weights)
    w = problem.weights
    expected = torch.zeros(problem.theta.numel(), dtype=torch.float64)
    for k in problem.holders():
        for r in range(int(problem.n_rounds)):
            drop = torch.as_tensor(problem.forget_masks[k])
            d = problem.client_history(k)[r] - fed.local_update(thetas[r], k, round_index=r, drop=drop)
            expected += float(w[k] / w.sum()) * d.double()
    share, info = replayed_share(problem, model, None, Ledger())
    assert float(expected.norm()) > 0 and torch.allclose(share, expected, atol=1e-6 * float(expected.norm()))
    assert [i["client"] for i in info] == problem.holders()
    assert share_rounds(20, 2) == [0, 19] and share_rounds(3, None) == [0, 1, 2] and share_rounds(3, 5) == [0, 1, 2]
    one, _ = replayed_share(problem, model, 1, Ledger())  # round 0 alone, standing for both rounds
    first = torch.zeros_like(expected)
    for k in problem.holders():
        drop = torch.as_tensor(problem.forget_masks[k])
        d = problem.client_history(k)[0] - fed.local_update(thetas[0], k, round_index=0, drop=drop)
        first += 2 * float(w[k] / w.sum()) * d.double()
    assert torch.allclose(one, first, atol=1e-6 * float(first.norm()))

    # a client absent from a round: its weight leaves that round's FedAvg denominator (and the rebuilt θ_t)
    history = problem.full_history().clone()
    absent = next(j for j in range(problem.n_clients) if j not in problem.holders())
    history[1, absent] = 0
    gappy = dataclasses.replace(problem, history=history)
    thetas = trajectory(gappy.theta_init, history, w)
    expected = torch.zeros_like(expected)
    for k in gappy.holders():
        drop = torch.as_tensor(gappy.forget_masks[k])
        for r in range(int(gappy.n_rounds)):
            present = [j for j in range(gappy.n_clients) if not (r == 1 and j == absent)]
            d = fed.local_update(thetas[r], k, round_index=r) - fed.local_update(thetas[r], k, round_index=r, drop=drop)
            expected += float(w[k] / w[present].sum()) * d.double()
    share_gappy, _ = replayed_share(gappy, model, None, Ledger())
    assert torch.allclose(share_gappy, expected, atol=1e-6 * float(expected.norm()))

    ease = Ease(EaseConfig(**FAST, holder_excision="replayed_share"))
    line = ease.line(problem, Ledger())
    u = line.subspaces.u_mu.double()
    assert torch.allclose(line.excision.double(), -(share - u @ (u.T @ share)), atol=1e-5 * float(share.norm()))
    assert line.bke[0]["source"] == "replayed share"
    info = ease.unlearn(problem).info
    assert info["holder_excision"] == "replayed_share" and info["excision_steps"] == 0
    assert not any("BKE" in item for item in info["bytes_by_item"]["up"])
    with pytest.raises(ValueError, match="holder_excision"):
        EaseConfig(holder_excision="retrain")
    # client scope never takes it: BKE at the leaving client (client_excision="bke") or the stored share
    bke = Ease(EaseConfig(**FAST, holder_excision="replayed_share", client_excision="bke", max_probes=1))
    client = bke.unlearn(tiny_demo().problem("client")).info
    assert client["holder_excision"] is None and client["bke"][0]["pair_grads"] > 0
    assert not any("replayed share" in item for item in client["bytes_by_item"]["down"])


def test_the_concept_of_a_class_deletion_is_the_word_in_every_forget_caption_and_no_retained_one():
    forget = ["a large purple circle", "a small Purple square at the top"]
    retained = ["a large red circle", "a small square"]
    assert concept_words(forget, retained) == ["purple"]
    assert without_words(forget, ["purple"]) == ["a large circle", "a small square at the top"]
    assert concept_words([], retained) == [] and without_words(forget, []) == forget


def test_the_concept_masked_reference_reads_the_forget_captions_without_the_classs_word():
    demo = tiny_demo()
    problem = demo.problem("class")
    k = problem.holders()[0]
    forget, retain = problem.forget_data(k), problem.retain_data(k)
    word = concept_words(forget.captions, retain.captions)
    assert word, "the class deletion's forget captions share a word no retained caption has"
    settings = {"steps": 3, "batch_size": 16, "objective": "reference", "reference_theta": demo.theta, "lr": 0.05,
                "retain": retain, "margin": -0.01}  # fmt: skip
    # the model as its own reference bounds nothing; reading the captions without the word, it does
    same, _ = bilateral_excision(demo.model, demo.theta, forget, **settings)
    masked, _ = bilateral_excision(
        demo.model, demo.theta, forget, reference_captions=without_words(forget.captions, word), **settings
    )
    assert torch.equal(same, demo.theta)
    assert not torch.equal(masked, demo.theta)
    # EASE's setting: every holder reads its own concept; the default keeps version 1
    for reference, expected in (("concept_masked", word), ("version_1", [])):
        info = get_method("ease").build({**FAST, "excision_reference": reference}).unlearn(problem).info
        assert [b["masked"] for b in info["bke"]] == [expected] * len(problem.holders())
        assert {b["reference"] for b in info["bke"]} == {"concept_masked" if expected else "version_1"}


def test_a_samples_deletion_can_run_from_the_holders_stored_updates_alone(monkeypatch):
    """``holder_excision="stored_updates"`` (method.py server_only): the holders' whole stored share is taken off by
    the server — no step reads the forget pairs, nothing is probed — and the holders' retained pairs come back in the
    protected repair rounds, which the holders take part in."""
    from app.ml.federation.accounting import Ledger
    from app.ml.unlearning.ease.method import Ease, forget_contribution

    demo = tiny_demo()
    problem = demo.problem("samples")
    holders = problem.holders()
    read, rounds = [], []
    original_forget, original_round = type(problem).forget_data, type(problem).run_round
    monkeypatch.setattr(
        type(problem), "forget_data", lambda self, *a, **k: read.append(a) or original_forget(self, *a, **k)
    )
    monkeypatch.setattr(
        type(problem),
        "run_round",
        lambda self, theta, clients=None, **k: (
            rounds.append(list(clients)) or original_round(self, theta, clients, **k)
        ),
    )
    settings = {**FAST, "holder_excision": "stored_updates"}
    result = get_method("ease").build(settings).unlearn(problem)
    assert read == [], "the forget pairs were read"
    info = result.info
    assert info["strength"]["mode"] == "stored_updates" and info["strength"]["probes"] == []
    assert [b["client"] for b in info["bke"]] == holders and info["bke"][0]["pair_grads"] == 0
    assert len(rounds) == EaseConfig().holder_repair_rounds and all(set(holders) <= set(c) for c in rounds)
    assert float((result.theta - demo.theta).norm()) > 0
    # the excision is minus the holders' FedAvg-weighted stored share, off U_μ
    line = Ease(EaseConfig(**settings)).line(demo.problem("samples"), Ledger())
    share = forget_contribution(demo.problem("samples"), holders).double()
    u = line.subspaces.u_mu.double()
    expected = -(share - u @ (u.T @ share))
    assert float(expected.norm()) > 0
    assert torch.allclose(line.excision.double(), expected, atol=1e-6 * float(expected.norm()))
    # the default takes this path for a samples deletion one client holds, without matched non-members; BKE otherwise
    auto = Ease(EaseConfig(**FAST))
    assert auto.for_problem(demo.problem("samples")).holder_excision == "stored_updates"
    two = demo.problem("samples")
    other = next(k for k in range(two.n_clients) if k not in holders)
    two.forget_masks[other] = np.arange(len(two.forget_masks[other])) == 0
    for problem in (demo.problem("class"), demo.problem("samples", nonmembers=demo.data.test), two):
        assert auto.for_problem(problem).holder_excision == "bke"
    # the holders' repair rounds are their own setting (None: offline_repair_rounds); a client deletion keeps its own
    default = EaseConfig()
    assert auto.for_problem(demo.problem("samples")).offline_repair_rounds == default.holder_repair_rounds
    unset = Ease(EaseConfig(**FAST, holder_repair_rounds=None)).for_problem(demo.problem("samples"))
    assert unset.offline_repair_rounds == default.offline_repair_rounds != default.holder_repair_rounds
    assert auto.for_problem(demo.problem("client")).offline_repair_rounds == default.offline_repair_rounds
    # where every client holds a forget pair nothing would be kept: refused
    everyone = demo.problem("samples")
    everyone.forget_masks = [m | (np.arange(len(m)) == 0) for m in everyone.forget_masks]
    with pytest.raises(ValueError, match="every client holds some"):
        get_method("ease").build(settings).unlearn(everyone)
