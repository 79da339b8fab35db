"""A simulated federation talking to Lethe over HTTP: what the demo and the tests use as "the clients".

Each round: download the global LoRA vector (``/versions/{n}/weights``), train locally on every client that is still
in the federation (``app.ml.federation.Federation.local_update``), upload the updates as one safetensors file, and
wait for the server to aggregate them into a new version. Before training, each client drops the pairs a deletion
took (``GET /v1/models/{id}/pairs`` lists what each client may still train on: the service's tombstones, published
as what is left). With ``use_lock`` the clients fetch the published forget lock and, when its α is positive, add its
penalty α‖U_μᵀ(θ − θ_unl)‖² to their local loss (EASE's default α = 0 needs no basis at the clients: the server's
projection alone holds the lock). This is client-side code: it runs the ML itself and is never imported by the API.
"""

from __future__ import annotations

import httpx
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from app.client import LetheClient
from app.ml.clip import ClipLoRA, ClipSpec
from app.ml.data.captions import CaptionDataset, federation_from_spec
from app.ml.federation import Federation, FedSettings
from app.ml.federation.lock import ForgetLock


def apply_tombstones(
    clients: list[CaptionDataset], client_ids: list[str], live: dict[str, list[str]]
) -> list[CaptionDataset]:
    """Each client's data without the pairs the service no longer lists for it (a client the service does not list
    keeps nothing)."""
    out = []
    for data, client_id in zip(clients, client_ids, strict=True):
        keep = set(live.get(client_id, []))
        out.append(data.subset([i for i, pid in enumerate(data.ids) if pid in keep]))
    return out


class SimulatedClients:
    """``client``: a :class:`~app.client.LetheClient`, or an httpx client (base URL and key set) that is wrapped in
    one."""

    def __init__(self, client: LetheClient | httpx.Client, model_id: str):
        self.api = client if isinstance(client, LetheClient) else LetheClient(http=client)
        self.model_id = model_id
        model = self._model()
        federation = model["federation"]
        self.clip = ClipLoRA(ClipSpec.from_dict(federation["spec"]))
        # simulated: every client's data is read here (a real client holds only its own pairs); a caption-file
        # federation needs the files under the same paths as the server's
        self.data, names = federation_from_spec(federation["data"], self.clip.preprocess())
        self.settings = FedSettings(**federation["fed_settings"])
        self.client_ids = federation["clients"]
        if names != self.client_ids:
            raise ValueError(f"the data's clients {names} are not the service's {self.client_ids}")
        self.fed = Federation(self.clip, self.data.clients, self.settings)
        self._live: dict[str, list[str]] | None = None

    def _model(self) -> dict:
        return self.api.get_model(self.model_id).model_dump(mode="json")

    def current_theta(self) -> tuple[int, torch.Tensor]:
        number = self._model()["current_version"]["number"]
        return number, load_tensors(self.api.version_weights(self.model_id, number))["theta"]

    def forget_lock(self) -> ForgetLock | None:
        meta = self.api.forget_lock(self.model_id)
        if meta is None or meta.alpha <= 0:
            return None  # no lock, or one the server's projection alone holds: the basis is not needed here
        return ForgetLock.from_bytes(self.api.forget_lock_tensors(self.model_id))

    def refresh_pairs(self) -> dict[str, list[str]]:
        """Drop the pairs deletions took (the service's published live pairs); rebuilds the local federation."""
        live = self.api.live_pairs(self.model_id)
        if live != self._live:
            self._live = live
            self.fed = Federation(self.clip, apply_tombstones(self.data.clients, self.client_ids, live), self.settings)
        return live

    def round(self, round_index: int, use_lock: bool = True, timeout: float = 600) -> dict:
        """One round: local training on every remaining client, upload, wait for the aggregated version (the
        aggregation job, as a dict)."""
        model = self._model()
        removed = set(model["federation"]["removed_clients"])
        self.refresh_pairs()
        number, theta = self.current_theta()
        lock = self.forget_lock() if use_lock else None
        penalty = lock.penalty if lock is not None else None
        updates = torch.zeros(len(self.client_ids), theta.numel())
        for k, client_id in enumerate(self.client_ids):
            if client_id not in removed and len(self.fed.clients[k]):
                updates[k] = self.fed.local_update(theta, k, round_index=round_index, penalty=penalty)
        blob = save_tensors({"updates": updates.contiguous(), "weights": self.fed.weights().float().contiguous()})
        job_id = self.api.submit_round(self.model_id, blob)
        try:
            return self.api.wait_job(job_id, timeout=timeout).model_dump(mode="json")
        except TimeoutError:
            raise TimeoutError(f"round {round_index} was not aggregated in {timeout} s") from None
