"""Why no LoRA replica can serve, as Serve's controller knows it, for the ingress to answer 503 instead of waiting."""

from __future__ import annotations

import asyncio
import time

from ray import serve

CHECK_INTERVAL_S = 2.0  # one controller call per interval at most, shared by every waiting request
MAX_MESSAGE_CHARS = 4000  # the controller's message holds the constructor's whole traceback


class ReplicaHealth:
    def __init__(self, app_name: str, deployment: str):
        self.app_name, self.deployment = app_name, deployment
        self._checked_at = -CHECK_INTERVAL_S
        self._check: asyncio.Future | None = None

    async def failure(self) -> str | None:
        """The replicas' start-up error while none of them runs; None while one runs or none has failed yet."""
        if self._check is None or time.monotonic() - self._checked_at >= CHECK_INTERVAL_S:
            self._checked_at = time.monotonic()
            self._check = asyncio.ensure_future(asyncio.to_thread(self._read))
        return await asyncio.shield(self._check)

    def _read(self) -> str | None:
        app = serve.status().applications.get(self.app_name)
        deployment = app.deployments.get(self.deployment) if app else None
        if deployment is None or deployment.replica_states.get("RUNNING", 0) > 0:
            return None
        # Serve says so in the status once its retries are spent, and in the message from the first failure on.
        failed = deployment.status in ("UNHEALTHY", "DEPLOY_FAILED") or "failed to start" in deployment.message
        if not failed:
            return None  # still starting
        message = deployment.message
        return message if len(message) <= MAX_MESSAGE_CHARS else "..." + message[-MAX_MESSAGE_CHARS:]
