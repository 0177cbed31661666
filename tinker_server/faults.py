"""Fault switches of the local Tinker server, for tests of retries and error handling.

`Faults` says how the server misbehaves: added latency on every work request, a share of
requests answered with HTTP 500 or 429 before any work is done (so a retry never doubles work),
and a share of futures that resolve as error futures. Session set-up and heartbeats are never
faulted; the random draws are seeded, so a test's faults are reproducible.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from tinker_server.futures import Outcome

__all__ = ["FAULTED_PATHS", "FaultInjector", "Faults"]

FAULTED_PATHS = frozenset(
    {
        "/api/v1/create_model",
        "/api/v1/forward_backward",
        "/api/v1/optim_step",
        "/api/v1/asample",
        "/api/v1/save_weights",
        "/api/v1/save_weights_for_sampler",
        "/api/v1/load_weights",
        "/api/v1/retrieve_future",
    }
)
"""The work endpoints faults apply to."""


class Faults(BaseModel):
    """How often and how the server fails on purpose (all off by default)."""

    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(0.0, ge=0, description="Added to every work request.")
    http_500_rate: float = Field(0.0, ge=0, le=1, description="Share answered with HTTP 500.")
    http_429_rate: float = Field(0.0, ge=0, le=1, description="Share answered with HTTP 429.")
    error_future_rate: float = Field(
        0.0, ge=0, le=1, description="Share of futures that resolve as error futures."
    )
    error_future_paths: frozenset[str] = Field(
        frozenset(), description="Only futures of these endpoints fail (empty: any endpoint)."
    )
    seed: int = Field(0, description="Seed of the random draws.")


class FaultInjector:
    """Draws the faults of `Faults` for each request."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self._random = random.Random(faults.seed)
        self.injected = {"http_500": 0, "http_429": 0, "error_future": 0}

    def status_for(self, path: str) -> int | None:
        """An HTTP status to answer `path` with instead of serving it, or None to serve it."""
        if path not in FAULTED_PATHS:
            return None
        draw = self._random.random()
        if draw < self.faults.http_500_rate:
            self.injected["http_500"] += 1
            return 500
        if draw < self.faults.http_500_rate + self.faults.http_429_rate:
            self.injected["http_429"] += 1
            return 429
        return None

    def latency_for(self, path: str) -> float:
        """Seconds to delay `path` by."""
        return self.faults.latency_s if path in FAULTED_PATHS else 0.0

    def future_outcome(self, path: str, outcome: Outcome) -> Outcome:
        """`outcome`, or an injected error future in its place."""
        paths = self.faults.error_future_paths
        if paths and path not in paths:
            return outcome
        if self._random.random() < self.faults.error_future_rate:
            self.injected["error_future"] += 1
            return Outcome(error=f"injected error future ({path})", category="server")
        return outcome
