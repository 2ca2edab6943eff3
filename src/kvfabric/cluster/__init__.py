"""kvfabric cluster: a controller with a global chunk index, peer-to-peer chunk transfer, the management API.

- `controller`: the HTTP service (FastAPI) and `run_controller` / `main` (`kvfabric controller`).
- `index`: the chunk index (in memory, or in Redis / Redis Cluster shared by several controllers).
- `protocol`, `p2p`: the framed binary protocol, `PeerServer` and `PeerClient`.
- `worker`: `ClusterNode` (observed local tiers + reporter + peer server + `tiers.peer.PeerTier`).
- `client`: `ControllerClient`, a small synchronous HTTP client of the controller.
Heavy imports (FastAPI, uvicorn) happen only in `controller`.
"""
