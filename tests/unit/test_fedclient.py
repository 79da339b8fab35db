import torch

from app.fedclient import apply_tombstones
from app.ml.data.captions import make_synthetic_federation


def test_clients_train_only_on_the_pairs_the_service_still_lists():
    data = make_synthetic_federation(0, n_clients=3, pairs_per_client=12, n_test=10)
    ids = ["c0", "c1", "c2"]
    live = {"c0": [], "c1": data.clients[1].ids[3:], "c2": data.clients[2].ids}
    out = apply_tombstones(data.clients, ids, live)
    assert [len(d) for d in out] == [0, 9, 12]
    assert out[1].ids == data.clients[1].ids[3:] and torch.equal(out[1].images, data.clients[1].images[3:])
    assert len(apply_tombstones(data.clients, ids, {})[2]) == 0  # a client the service does not list keeps nothing
