"""The webhook sender: a loop that delivers the webhook outbox (app/webhooks/service.py), apart from job workers.

Runs as a thread beside the dispatcher (``lethe serve``, the embedded default) or on its own
(``lethe webhook-sender``); several may run at once (rows are taken with SKIP LOCKED).
"""

from __future__ import annotations

import logging
import threading

from app.webhooks.service import send_due

log = logging.getLogger("lethe.webhooks")


class WebhookSender:
    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> dict[str, int]:
        return send_due()

    def run_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # a database hiccup: the next tick retries
                log.exception("webhook sender tick failed; retrying")
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run_forever, name="lethe-webhooks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
