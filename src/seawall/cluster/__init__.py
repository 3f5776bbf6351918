"""Many gateway instances, one fleet: the shared store, leadership and the role manager.

- `store.py`: the primitives every shared feature is built on (membership, leadership
  with a fencing epoch, fenced key/value, list and hash writes), the `ClusterStore`
  protocol and `MemoryStore` (one process).
- `redis_store.py`: `RedisStore`, the same over Redis (Lua for the compare-and-set parts).
- `local.py`: `StoreServer` (a `MemoryStore` behind a Unix socket) and `LocalStoreClient`,
  for several processes on one host with no extra setup.
- `kube.py`: `KubernetesLeaseElector`, leadership through a coordination.k8s.io Lease.
- `report.py`: what every instance heartbeats (its in-flight counts per replica).
- `roles.py`: `RoleManager`, owned by the composition root: heartbeats, elections,
  publishing (leader) or following (followers) the fleet view, and fail-static.
"""
