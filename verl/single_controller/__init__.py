"""Single controller over SPMD ranks: dispatch modes, ``@register``, workers and worker groups."""

from verl.single_controller.decorator import (
                                              Dispatch,
                                              DispatchInfo,
                                              DispatchSpec,
                                              MeshRank,
                                              make_nd_compute_dataproto_dispatch_fn,
                                              register,
)
from verl.single_controller.worker import Worker
from verl.single_controller.worker_group import ResourcePool, WorkerGroup, all_gather_objects, broadcast_object

__all__ = ["Dispatch", "DispatchInfo", "DispatchSpec", "MeshRank", "ResourcePool", "Worker", "WorkerGroup",
           "all_gather_objects", "broadcast_object", "make_nd_compute_dataproto_dispatch_fn", "register"]
