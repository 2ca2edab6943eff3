"""kvfabric cluster: a controller with a global chunk index, peer-to-peer chunk transfer, the management API.

- `controller`: serves the HTTP controller (`run_controller` / `main`, `kvfabric controller`); built from
  `controller_models` (API schema), `controller_guard` (body bound, metrics), `controller_service` (the logic)
  and `controller_app` (`create_app`, the routes).
- `index`: the chunk index's data model, protocol and `open_index`; backends `index_memory` and `index_redis`
  (Redis / Redis Cluster shared by several controllers).
- `protocol`: the framed binary P2P protocol; `p2p_server` (`PeerServer`), `p2p_client` (`PeerClient`,
  `PeerPool`).
- `peer`: `PeerTier`, the read-only tier over the other instances' chunks.
- `worker`: `ClusterNode` (observed local tiers + reporter from `worker_reporting` + peer server + peer tier).
- `client`: `ControllerClient`, a small synchronous HTTP client of the controller.
The cluster imports tiers (it serves and wraps them); tiers never import the cluster. Heavy imports (FastAPI,
uvicorn) happen only in `controller` and its `controller_*` modules.
"""
