import numpy as np
import pytest
import torch

from app.ml.unlearning.base import InvalidMethodSettingsError, available_methods, get_method
from app.ml.unlearning.ease import EaseConfig, ForgetLock
from app.ml.unlearning.ease.excision import bilateral_excision, excision_loss

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


def test_offline_leaving_client_runs_from_the_stored_updates_alone():
    """leaving_client="offline" (client scope): no step reads the leaving client's pairs — the excision is its stored
    FedAvg share, the strength is not probed — and the result still moves off the original and is locked."""
    demo = tiny_demo()
    problem = demo.problem("client")
    leaving = int(problem.forget_client)
    read = []
    original = type(problem).forget_data

    def forget_data(self, *args, **kwargs):
        read.append(args)
        return original(self, *args, **kwargs)

    problem.forget_data = forget_data.__get__(problem)
    result = get_method("ease").build({**FAST, "leaving_client": "offline"}).unlearn(problem)
    assert read == [], "an offline leaving client's pairs were read"
    info = result.info
    assert info["leaving_client"] == "offline" and info["strength"]["mode"] == "offline"
    assert info["strength"]["probes"] == [] and info["pair_grads"] > 0  # the repair rounds, at retained clients only
    assert info["bke"][0]["client"] == leaving and info["bke"][0]["pair_grads"] == 0
    assert not any("BKE" in item or "probes" in item for side in info["bytes_by_item"].values() for item in side)
    lock = ForgetLock.from_bytes(result.artifacts["forget_lock"])
    assert lock.drift(result.theta) == pytest.approx(0.0, abs=1e-6)
    assert float((result.theta - demo.theta).norm()) > 0
    # the same settings on a class deletion are refused: its holders' pairs are indispensable there
    with pytest.raises(ValueError, match="client scope only"):
        get_method("ease").build({**FAST, "leaving_client": "offline"}).unlearn(demo.problem("class"))
