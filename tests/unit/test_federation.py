import torch

from app.ml.federation import Federation, FedSettings, apply_round, bytes_of, fedavg, trajectory

from .clip_helpers import tiny_demo, tiny_model


def test_two_rounds_record_history_and_bytes():
    demo = tiny_demo()
    p = demo.model.num_params
    assert demo.history.shape == (2, 3, p)
    assert (demo.history.abs().sum(dim=2) > 0).all()  # every client, every round
    assert demo.bytes_total == 2 * 3 * 2 * bytes_of(p)  # rounds × clients × (down + up) × 4 bytes · p
    # the final model is θ₀ plus the FedAvg of the recorded updates
    thetas = trajectory(demo.theta_init, demo.history, demo.weights)
    assert torch.allclose(thetas[-1], demo.theta, atol=1e-5)


def test_apply_round_and_hooks():
    updates = torch.tensor([[1.0, 0.0, 2.0], [3.0, 2.0, 0.0]])
    assert torch.allclose(fedavg(updates, [1, 3]), torch.tensor([2.5, 1.5, 0.5]))
    theta = torch.ones(3)
    out = apply_round(theta, updates, projection=lambda d: d * torch.tensor([1.0, 0.0, 1.0]))
    assert torch.allclose(out, torch.tensor([3.0, 1.0, 2.0]))

    demo = tiny_demo()
    fed = Federation(demo.model, demo.data.clients, FedSettings(rounds=1, batch_size=12))
    seen = []

    def projection(d: torch.Tensor) -> torch.Tensor:
        seen.append(d.clone())
        return torch.zeros_like(d)

    res = fed.run_round(demo.theta, [0, 1], projection=projection)
    assert len(seen) == 1 and torch.equal(res.theta, demo.theta) and res.updates.shape[0] == 2
    assert res.bytes_down == res.bytes_up == 2 * bytes_of(demo.model.num_params)

    # a strong client penalty pins the local model to its anchor
    anchor = demo.theta.clone()
    free = fed.local_update(demo.theta, 0)
    pinned = fed.local_update(demo.theta, 0, penalty=lambda t: 1e4 * ((t - anchor.to(t.device)) ** 2).sum())
    assert pinned.norm() < 0.2 * free.norm()


def test_local_update_is_deterministic():
    m = tiny_model()
    demo = tiny_demo()
    fed = Federation(m, demo.data.clients, FedSettings(batch_size=12))
    a = fed.local_update(m.theta_init, 1, round_index=3)
    b = fed.local_update(m.theta_init, 1, round_index=3)
    assert torch.allclose(a, b, atol=1e-7)  # same data order, frozen weights restored (see clip._mha_base_weights)
    assert not torch.allclose(a, fed.local_update(m.theta_init, 1, round_index=4), atol=1e-6)
