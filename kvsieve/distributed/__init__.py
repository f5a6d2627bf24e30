"""Running kvsieve's work on Ray: connecting to a cluster, and a pool of long-lived worker actors.

Ray is an optional dependency (``pip install 'kvsieve[ray]'``); nothing here imports it until used. The
executors that use these pieces live with their work: ``harness/executor.py`` (grids) and
``evolve/ray_candidate_executor.py`` (evolution candidates).
"""

from kvsieve.distributed.cluster import RayConnection, connect
from kvsieve.distributed.pool import WorkerLost, WorkerPool

__all__ = ["RayConnection", "connect", "WorkerPool", "WorkerLost"]
