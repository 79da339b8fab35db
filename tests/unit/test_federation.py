import pytest
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


def test_rounds_record_compute_critical_path_and_pair_gradients():
    demo = tiny_demo()
    fed = Federation(demo.model, demo.data.clients, FedSettings(rounds=2, batch_size=12))
    result = fed.train(demo.theta_init)
    for res in result.rounds:
        assert len(res.client_seconds) == 3 and all(s > 0 for s in res.client_seconds)
        assert res.critical_seconds < res.compute_seconds  # three clients in parallel beat three in a row
        assert res.pair_grads == sum(fed.local_steps(k) * 12 for k in range(3))
    assert result.pair_grads == 2 * result.rounds[0].pair_grads
    assert result.critical_seconds == pytest.approx(sum(r.critical_seconds for r in result.rounds))


def test_ledger_stages_count_parallel_parties_once_on_the_critical_path():
    from app.ml.federation.accounting import Ledger

    ledger = Ledger()
    ledger.stage("a", {"client 0": 1.0, "client 1": 3.0, "server": 0.5}, pair_grads=10)
    ledger.stage("b", {"server": 2.0}, pair_forwards=7)
    ledger.down("x", 8)
    ledger.up("y", 4)
    info = ledger.to_info()
    assert info["compute_seconds"] == 6.5 and info["critical_seconds"] == 5.0
    assert info["pair_grads"] == 10 and info["pair_forwards"] == 7 and info["bytes_total"] == 12
    # issue 24 item 4: a stage in which clients take part is one client round trip; a server-only stage is none
    assert info["client_round_trips"] == 1


def test_a_federated_deletion_drops_the_workers_decoded_copy_of_the_clients_data():
    """Issue 22, LOW (worker caches): the worker keeps the clients' decoded pairs in memory between jobs; a deletion's
    upkeep (after the certificate) drops that copy, which held the erased pairs, so they leave the worker with it."""
    import json

    from app.jobs import federated

    data = {"kind": "synthetic", "seed": 0, "n_clients": 3, "pairs_per_client": 4, "n_test": 4}
    federated._federation_data.cache_clear()
    federated._federation_data(json.dumps(data, sort_keys=True), "{}")
    assert federated._federation_data.cache_info().currsize == 1
    assert federated.Deletion().upkeep("m", None) == {"federation_cache": "dropped"}
    assert federated._federation_data.cache_info().currsize == 0


def test_a_cached_federation_is_keyed_by_its_planted_fractions(tmp_path):
    """bench/ease.py trains the samples scenario's federation with a larger data subject: the training cache must not
    hand it the default federation's θ (the key holds the fractions)."""
    from app.ml.clip import LoraSettings
    from app.ml.federation import FedSettings, make_demo_federation

    from .clip_helpers import TINY_PRETRAIN

    def build(fractions):
        return make_demo_federation(
            seed=0, n_clients=3, pairs_per_client=20, n_test=8, fed_settings=FedSettings(rounds=1, batch_size=10),
            pretrain=TINY_PRETRAIN, lora=LoraSettings(rank=2), cache_dir=str(tmp_path), device="cpu",
            cache_training=True, fractions=fractions,
        )  # fmt: skip

    default, subject = build(None), build({"ring": 0.5})
    assert sum(subject.data.forget_masks("samples")[-1]) == 10 > sum(default.data.forget_masks("samples")[-1])
    assert len(list((tmp_path / "federations").glob("*.pt"))) == 2
    assert not torch.equal(default.theta, subject.theta)
    assert torch.equal(build({"ring": 0.5}).theta, subject.theta)  # and the cache serves it again
