"""A simulated federation talking to Lethe over HTTP: what the demo and the tests use as "the clients".

Each round: download the global LoRA vector (``/versions/{n}/weights``), train locally on every client that is still
in the federation (``app.ml.federation.Federation.local_update``), upload the updates as one safetensors file, and
wait for the server to aggregate them into a new version. With ``use_lock`` the clients fetch the published forget
lock and add its penalty α‖U_μᵀ(θ − θ_unl)‖² to their local loss (EASE, Projection with Forget Lock).
This is client-side code: it runs the ML itself and is never imported by the API.
"""

from __future__ import annotations

import time

import httpx
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from app.ml.clip import ClipLoRA, ClipSpec
from app.ml.data.captions import make_synthetic_federation
from app.ml.federation import Federation, FedSettings
from app.ml.federation.lock import ForgetLock


class SimulatedClients:
    def __init__(self, client: httpx.Client, model_id: str):
        self.http, self.model_id = client, model_id
        model = self._model()
        federation = model["federation"]
        data = {k: v for k, v in federation["data"].items() if k != "kind"}
        self.data = make_synthetic_federation(**data)
        self.clip = ClipLoRA(ClipSpec.from_dict(federation["spec"]))
        self.settings = FedSettings(**federation["fed_settings"])
        self.fed = Federation(self.clip, self.data.clients, self.settings)
        self.client_ids = federation["clients"]

    def _model(self) -> dict:
        response = self.http.get(f"/v1/models/{self.model_id}")
        response.raise_for_status()
        return response.json()

    def current_theta(self) -> tuple[int, torch.Tensor]:
        number = self._model()["current_version"]["number"]
        response = self.http.get(f"/v1/models/{self.model_id}/versions/{number}/weights")
        response.raise_for_status()
        return number, load_tensors(response.content)["theta"]

    def forget_lock(self) -> ForgetLock | None:
        response = self.http.get(f"/v1/models/{self.model_id}/forget-lock.safetensors")
        return ForgetLock.from_bytes(response.content) if response.status_code == 200 else None

    def round(self, round_index: int, use_lock: bool = True, timeout: float = 600) -> dict:
        """One round: local training on every remaining client, upload, wait for the aggregated version."""
        model = self._model()
        removed = set(model["federation"]["removed_clients"])
        number, theta = self.current_theta()
        lock = self.forget_lock() if use_lock else None
        penalty = lock.penalty if lock is not None else None
        updates = torch.zeros(len(self.client_ids), theta.numel())
        for k, client_id in enumerate(self.client_ids):
            if client_id not in removed:
                updates[k] = self.fed.local_update(theta, k, round_index=round_index, penalty=penalty)
        blob = save_tensors({"updates": updates.contiguous(), "weights": self.fed.weights().float().contiguous()})
        response = self.http.post(
            f"/v1/models/{self.model_id}/rounds", content=blob, headers={"content-type": "application/octet-stream"}
        )
        response.raise_for_status()
        job_id = response.json()["job_id"]
        deadline = time.monotonic() + timeout
        while True:
            job = self.http.get(f"/v1/jobs/{job_id}").json()
            if job["status"] in ("succeeded", "failed"):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {round_index} was not aggregated in {timeout} s")
            time.sleep(0.1)
