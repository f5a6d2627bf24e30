"""Connect this process (the driver) to Ray: a local instance, or an existing cluster.

``address=None`` starts a local Ray instance with this machine's CPUs (unless Ray's own ``RAY_ADDRESS``
environment variable names a cluster); ``"auto"`` joins the cluster this machine is a node of (``ray
start`` was run here); ``"HOST:PORT"`` joins the cluster whose head's GCS listens there. Whatever
:func:`connect` started or joined, :meth:`RayConnection.close` leaves; a Ray session the caller had
already opened is left alone.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["RayConnection", "connect", "import_ray", "check_reachable"]

PROBE_TIMEOUT_S = 10.0


def import_ray():
    try:
        import ray
    except ImportError as err:  # an optional dependency
        raise ValueError("the Ray executor needs ray: pip install 'kvsieve[ray]' (ray==2.60.0)") from err
    return ray


@dataclass
class RayConnection:
    owned: bool  # this connection called ray.init, so close() calls ray.shutdown
    address: str | None

    def cpus(self) -> int:
        """CPUs of the whole cluster (every node's), as Ray counts them."""
        return max(1, int(import_ray().cluster_resources().get("CPU", 1)))

    def close(self) -> None:
        if self.owned:
            ray = import_ray()
            if ray.is_initialized():
                ray.shutdown()
            self.owned = False


def connect(address: str | None = None, num_cpus: int | None = None) -> RayConnection:
    """Start or join Ray (see the module docstring). ``num_cpus`` only applies to a started instance."""
    ray = import_ray()
    if address is not None:
        check_reachable(address)  # also when Ray is already up: a dead address is the user's mistake to hear of
    if ray.is_initialized():
        return RayConnection(False, address)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        # "local": always a new instance, never a stale cluster recorded in /tmp/ray/ray_current_cluster
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False)
    else:
        check_reachable(address)  # RAY_ADDRESS too
        ray.init(address=address)
    return RayConnection(True, address)


def check_reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse a ``HOST:PORT`` where nothing accepts connections, before Ray retries it forever.

    ``ray.init`` on a dead address logs a warning per retry and never returns; a TCP connect with a
    deadline tells the user in seconds. ``auto`` and ``ray://`` addresses are left to Ray.
    """
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r}: expected auto or HOST:PORT (the head's GCS port, "
                         "6379 by default)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise ValueError(f"--ray-address {address}: no Ray head reachable there ({err.strerror or err}) within "
                         f"{timeout_s:.0f} s; start one with `ray start --head --port {port}` on that machine, or "
                         "leave --ray-address out to start a local instance") from None
