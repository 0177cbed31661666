"""verl's worker group, watched for lost workers: a rank whose process or node died.

verl's `RayWorkerGroup` waits with `ray.get` on the ranks it collects (often rank 0 alone), so a
rank lost mid-call leaves the caller waiting on a survivor, which fails in its collective (gloo)
or blocks there (NCCL) until `verl.call_timeout_s`. `WatchedWorkerGroup` waits on every rank's
reply as each call is made: a rank whose actor died, or whose node left the cluster, ends the
call within seconds as one `WorkerLostError` naming the rank and its node. Every call of the
group goes through `execute_all_async`, so this one override watches them all.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from verl.single_controller.ray import RayWorkerGroup

from unified.errors import BackendError

__all__ = ["WatchedWorkerGroup", "WorkerLostError"]

POLL_S = 0.5
"""How often a call in flight checks its ranks' nodes."""

NAMING_GRACE_S = 60.0
"""After a rank fails, how long to wait for Ray to say whether another rank was lost: a peer's
death reaches the survivors (a broken collective) before the cluster's health checks see it, which
takes up to tens of seconds at Ray's defaults."""


class WorkerLostError(BackendError):
    """A rank of the verl worker group died with its process or its node: the run cannot go on."""


class WatchedWorkerGroup(RayWorkerGroup):
    """verl's `RayWorkerGroup`, whose calls fail in seconds when one of its ranks is lost."""

    _watching = False  # verl's own set-up calls go unwatched: the ranks' nodes are not known yet

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nodes: list[str] = ray.get([w.node_id.remote() for w in self._workers])
        """Each rank's Ray node id."""
        self._watching = True

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        refs: list[Any] = super().execute_all_async(method_name, *args, **kwargs)
        if self._watching:
            self._wait(method_name, refs)
        return refs

    def _wait(self, method: str, refs: list[Any]) -> None:
        """Return once every rank replied; raise as soon as one is known lost, or (after
        `NAMING_GRACE_S` to learn whether a rank was lost) with the first rank's failure."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        failed: tuple[int, BaseException] | None = None
        give_up = float("inf")
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self._lost(rank_of[ref], method, e) from e
                except Exception as e:  # the rank's own failure: maybe a peer lost mid-collective
                    if failed is None:
                        failed, give_up = (rank_of[ref], e), time.monotonic() + NAMING_GRACE_S
            for rank in self._ranks_on_dead_nodes() if pending else ():
                raise self._lost(rank, method, None)
            if failed is not None and (not pending or time.monotonic() > give_up):
                raise failed[1]

    def _ranks_on_dead_nodes(self) -> list[int]:
        alive = {n["NodeID"] for n in _cluster_nodes() if n.get("Alive")}
        return [rank for rank, node in enumerate(self.nodes) if alive and node not in alive]

    def _lost(self, rank: int, method: str, error: BaseException | None) -> WorkerLostError:
        node = self.nodes[rank]
        known = {n["NodeID"]: n for n in _cluster_nodes()}
        where = known.get(node, {}).get("NodeManagerAddress", "?")
        dead = bool(known) and not known.get(node, {}).get("Alive", False)
        why = "its node left the cluster" if dead else "its worker process died"
        if error is not None and not dead:
            why += f" ({type(error).__name__})"
        return WorkerLostError(
            f"verl worker rank {rank} of {len(self.nodes)} on node {node[:12]} at {where} was "
            f"lost during {method}: {why}; the group cannot train without it, so the run stops"
        )


def _cluster_nodes() -> list[dict[str, Any]]:
    """Ray's node table; empty when its control service does not answer (ask again later)."""
    try:
        return list(ray.nodes())
    except Exception:
        return []
