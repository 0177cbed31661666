"""Starting or joining Ray: for the rollout workers (`rollout.workers`) and the verl backend.

Importing this module imports Ray; import it only where Ray is wanted.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

__all__ = ["init_ray", "start_local_ray"]

log = logging.getLogger(__name__)


def start_local_ray(num_cpus: int, **settings: Any) -> None:
    """Start a private Ray on 127.0.0.1 with `num_cpus` CPUs (blocking: seconds to a minute).

    Its workers run at the trainer's priority: Ray's default (`nice` +15) would hand their
    workflows' CPU to any other process on a busy machine. Ray's driver logs errors only: its
    start-up notices (auth token, signal handler, "Started a local Ray instance") say nothing a
    user of a private, loopback-only Ray can act on. `settings` go to `ray.init` as well.
    """
    init_ray(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        logging_level=logging.ERROR,
        _system_config={"worker_niceness": 0},
        **settings,
    )


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
