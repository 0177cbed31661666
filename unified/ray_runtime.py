"""Starting or joining Ray: for the rollout workers (`rollout.workers`) and the verl backend.

Importing this module imports Ray; import it only where Ray is wanted.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
import ray._private.ray_constants as ray_constants

__all__ = ["init_ray", "join_ray", "start_local_ray"]

log = logging.getLogger(__name__)


def start_local_ray(num_cpus: int, **settings: Any) -> None:
    """Start a private Ray on 127.0.0.1 with `num_cpus` CPUs (blocking: seconds to a minute);
    without `_loopback_only` Ray would put it on this machine's network address instead.

    Its workers run at the trainer's priority: Ray's default (`nice` +15) would hand their
    workflows' CPU to any other process on a busy machine. Ray's driver logs errors only: its
    start-up notices (auth token, signal handler, "Started a local Ray instance") say nothing a
    user of a private, loopback-only Ray can act on. `settings` go to `ray.init` as well.
    """
    _loopback_only()
    init_ray(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        logging_level=logging.ERROR,
        _system_config={"worker_niceness": 0},
        **settings,
    )


def join_ray(address: str, **settings: Any) -> None:
    """Join the Ray cluster at `address` (`auto`, `host:port`, `ray://host:port`); `settings`
    go to `ray.init` as well.

    A cluster on the loopback address (every node started with `--node-ip-address=127.0.0.1`,
    as the tests' clusters are) is joined from the loopback address too: Ray turns 127.0.0.1 in
    an address into this machine's network address, where nothing of it listens (Ray issue
    59110), unless told it is not a cluster of several machines, the setting
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which the processes Ray starts from here inherit.
    """
    host = address.split("://")[-1].rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost"):
        _loopback_only()
    init_ray(address=address, **{"logging_level": logging.ERROR, **settings})


def _loopback_only() -> None:
    """Keep this process's Ray, and the processes it starts, on 127.0.0.1 (see `join_ray`)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import; Ray is imported already


def init_ray(**settings: Any) -> None:
    """`ray.init(**settings)`, tried once more if the node did not start in time.

    Ray gives its raylet a fixed 30 s to register at start-up, which a loaded machine can miss.
    """
    try:
        ray.init(**settings)
    except Exception as e:
        if "timed out during startup" not in str(e):
            raise
        log.warning("Ray did not start in time (%s); trying once more", e)
        ray.shutdown()
        ray.init(**settings)
