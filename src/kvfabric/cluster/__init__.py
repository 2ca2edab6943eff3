"""kvfabric cluster: a controller with a global chunk index, peer-to-peer chunk transfer, the management API.

- `controller`: the HTTP service (FastAPI) and `run_controller` / `main` (`kvfabric controller`); built from
  `controller_models` (API schema), `controller_guard` (body bound, metrics), `controller_service` (the logic)
  and `controller_app` (routes).
- `index`: the chunk index (in memory, or in Redis / Redis Cluster shared by several controllers); built from
  `index_types`, `index_memory` and `index_redis`.
- `protocol`, `p2p`: the framed binary protocol, `PeerServer` and `PeerClient`.
- `worker`: `ClusterNode` (observed local tiers + reporter from `worker_reporting` + peer server +
  `tiers.peer.PeerTier`).
- `client`: `ControllerClient`, a small synchronous HTTP client of the controller.
Heavy imports (FastAPI, uvicorn) happen only in `controller` and its `controller_*` modules.
"""
