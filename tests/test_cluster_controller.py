"""The controller's HTTP API in process (ASGI test client): auth, validation, bounds, lookup semantics, expiry,
metrics, the Redis-down path, and a schemathesis fuzz run over the published OpenAPI schema."""
from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from kvfabric.cluster.controller import check_bind, main
from kvfabric.cluster.controller_app import create_app
from kvfabric.cluster.index_memory import MemoryIndex
from kvfabric.cluster.index_redis import RedisIndex
from kvfabric.kv.hashing import chunk_keys
from tests.cluster_scripts.helpers import wait_for
from tests.redis_fixtures import needs_redis, redis_server  # noqa: F401  (fixture)

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = "11" * 32
OTHER_ROOT = "22" * 32


def namespace(root=ROOT, chunk_size=4, model_id="m"):
    return {"model_id": model_id, "root": root, "chunk_size": chunk_size}


def register(client, instance_id, port=9000, tiers=("cpu", "disk"), namespaces=None):
    body = {"instance_id": instance_id, "host": "127.0.0.1", "port": port,
            "tiers": [{"name": t, "capacity_bytes": 1000} for t in tiers],
            "namespaces": namespaces if namespaces is not None else [namespace()]}
    r = client.post("/v1/workers/register", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def admit(client, instance_id, tier, keys):
    r = client.post(f"/v1/workers/{instance_id}/events", json={"admit": {tier: [k.hex() for k in keys]}}, headers=AUTH)
    assert r.status_code == 200 and r.json()["known"], r.text


def keys_of(tokens, root=ROOT, chunk_size=4):
    return chunk_keys(tokens, bytes.fromhex(root), chunk_size)


@pytest.fixture
def client():
    app = create_app(MemoryIndex(), token=TOKEN, instance_ttl_s=30, max_body_bytes=64 * 1024)
    with TestClient(app) as c:
        c.controller = app.controller
        yield c


def test_health_is_open_everything_else_needs_the_token(client):
    assert client.get("/v1/health").json() == {"status": "ok", "index": "memory", "index_ok": True, "instances": 0}
    for method, path in [("get", "/v1/instances"), ("get", "/metrics"), ("post", "/v1/lookup"),
                         ("post", "/v1/clear"), ("post", "/v1/workers/register")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"},
                        {"Authorization": f"Bearer {TOKEN}x"}):
            r = getattr(client, method)(path, headers=headers, **({"json": {}} if method == "post" else {}))
            assert r.status_code in (401, 403), (path, headers, r.status_code)
    assert client.get("/v1/instances", headers=AUTH).status_code == 200


def test_openapi_schema_is_published(client):
    schema = client.get("/openapi.json").json()
    assert {"/v1/lookup", "/v1/pin", "/v1/unpin", "/v1/clear", "/v1/move", "/v1/health", "/v1/instances",
            "/metrics", "/v1/workers/register"} <= set(schema["paths"])


def test_lookup_by_tokens_gives_each_instance_its_prefix_and_tier(client):
    tokens = list(range(20))  # 5 chunks of 4
    keys = keys_of(tokens)
    register(client, "a", 9001)
    register(client, "b", 9002)
    register(client, "c", 9003, namespaces=[namespace(OTHER_ROOT)])  # another model: other keys
    admit(client, "a", "cpu", keys[:2])
    admit(client, "a", "disk", keys[1:4])
    admit(client, "b", "cpu", keys[:1] + keys[2:])  # a gap after chunk 0
    r = client.post("/v1/lookup", json={"tokens": tokens}, headers=AUTH)
    assert r.status_code == 200, r.text
    hits = {h["instance_id"]: h for h in r.json()["instances"]}
    assert hits["a"]["prefix_chunks"] == 4 and hits["a"]["prefix_tokens"] == 16
    assert hits["a"]["tiers"] == {"cpu": 2, "disk": 2} and hits["a"]["tier"] == "disk"
    assert (hits["a"]["host"], hits["a"]["port"]) == ("127.0.0.1", 9001)
    assert hits["b"]["prefix_chunks"] == 1 and hits["b"]["tier"] == "cpu"
    assert hits["c"]["prefix_chunks"] == 0 and hits["c"]["tier"] is None
    assert [h["instance_id"] for h in r.json()["instances"]] == ["a", "b", "c"]  # longest prefix first
    # partial prompt: prefix_tokens never exceeds the prompt
    r = client.post("/v1/lookup", json={"tokens": tokens[:9], "model_id": "m", "exclude": ["b", "c"]}, headers=AUTH)
    assert [(h["instance_id"], h["prefix_tokens"]) for h in r.json()["instances"]] == [("a", 8)]
    # a model nobody serves
    r = client.post("/v1/lookup", json={"tokens": tokens, "model_id": "nope"}, headers=AUTH)
    assert r.json() == {"instances": []}


def test_lookup_by_keys_with_detail(client):
    keys = keys_of(list(range(12)))
    register(client, "a")
    admit(client, "a", "disk", keys[1:])
    admit(client, "a", "cpu", keys[2:])
    r = client.post("/v1/lookup", json={"keys": [k.hex() for k in keys], "detail": True}, headers=AUTH)
    (hit,) = r.json()["instances"]
    assert hit["prefix_chunks"] == 0 and hit["prefix_tokens"] is None
    assert hit["chunk_tiers"] == [[], ["disk"], ["cpu", "disk"]]  # fastest first


def test_evicts_heartbeats_and_re_registration(client):
    keys = keys_of(list(range(8)))
    register(client, "a")
    admit(client, "a", "cpu", keys)
    r = client.post("/v1/workers/a/events", json={"evict": {"cpu": [keys[0].hex()]}}, headers=AUTH)
    assert r.json()["known"]
    assert client.post("/v1/lookup", json={"tokens": list(range(8))}, headers=AUTH).json()["instances"][0][
        "prefix_chunks"] == 0
    r = client.post("/v1/workers/a/heartbeat", json={"tiers": [{"name": "cpu", "num_chunks": 1}]}, headers=AUTH)
    assert r.json() == {"ok": True, "known": True}
    (view,) = client.get("/v1/instances", headers=AUTH).json()["instances"]
    assert view["tiers"][0]["num_chunks"] == 1 and view["indexed_chunks"] == {"cpu": 1}
    assert client.post("/v1/workers/zz/heartbeat", json={}, headers=AUTH).json()["known"] is False
    assert client.post("/v1/workers/zz/events", json={"admit": {"cpu": []}}, headers=AUTH).json()["known"] is False
    assert client.delete("/v1/workers/a", headers=AUTH).json()["known"] is True
    assert client.get("/v1/instances", headers=AUTH).json()["instances"] == []


def test_silent_instances_are_dropped():
    app = create_app(MemoryIndex(), instance_ttl_s=0.3, sweep_interval_s=0.1)
    with TestClient(app) as c:
        register(c, "a")
        admit(c, "a", "cpu", keys_of(list(range(4))))
        assert len(c.post("/v1/lookup", json={"tokens": list(range(4))}).json()["instances"]) == 1
        wait_for(lambda: c.post("/v1/lookup", json={"tokens": list(range(4))}).json()["instances"] == [], 30)
        wait_for(lambda: app.controller.index.instances() == [], 30)  # and swept, entries too
        assert app.controller.index.locate(keys_of(list(range(4)))) == [{}]
        assert c.post("/v1/workers/a/heartbeat", json={}).json()["known"] is False


@pytest.mark.parametrize("body", [
    {"tokens": [1, 2], "keys": ["00" * 32]},  # both
    {},  # neither
    {"tokens": [-1]},
    {"tokens": [2**32]},
    {"tokens": ["1"]},
    {"tokens": [1.5]},
    {"keys": ["zz" * 32]},
    {"keys": ["00" * 31]},
    {"tokens": [1], "unexpected": 1},
    {"tokens": [1], "exclude": ["bad id with spaces"]},
    [1, 2, 3],
    "just a string",
])
def test_malformed_lookups_get_422(client, body):
    assert client.post("/v1/lookup", json=body, headers=AUTH).status_code == 422


@pytest.mark.parametrize("raw", [b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b"null", b"1e999999",
                                 b'{"tokens": [' + b"9" * 5000 + b"]}"])
def test_garbage_bodies_get_4xx(raw):
    app = create_app(MemoryIndex(), max_body_bytes=1 << 20)
    with TestClient(app) as c:
        r = c.post("/v1/lookup", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (raw[:20], r.status_code)
        assert c.get("/v1/health").status_code == 200


@pytest.mark.parametrize("body", [
    {"instance_id": "a", "host": "example.com", "port": 1},  # hostnames: no DNS on a client's behalf
    {"instance_id": "a", "host": "127.0.0.1", "port": 0},
    {"instance_id": "a", "host": "127.0.0.1", "port": 70000},
    {"instance_id": "a/../b", "host": "127.0.0.1", "port": 1},
    {"instance_id": "a", "host": "127.0.0.1", "port": 1, "tiers": [{"name": "CPU!"}]},
    {"instance_id": "a", "host": "127.0.0.1", "port": 1,
     "namespaces": [{"model_id": "m", "root": "x", "chunk_size": 4}]},
    {"instance_id": "a", "host": "127.0.0.1", "port": 1,
     "namespaces": [{"model_id": "m", "root": ROOT, "chunk_size": 4, "hash": "md5"}]},
])
def test_bad_registrations_get_422(client, body):
    assert client.post("/v1/workers/register", json=body, headers=AUTH).status_code == 422


def test_body_size_limit(client):
    big = {"tokens": list(range(20000))}  # > 64 KiB of JSON
    assert client.post("/v1/lookup", json=big, headers=AUTH).status_code == 413

    def chunks():  # no Content-Length: streamed, counted as it arrives
        yield b'{"tokens": ['
        for _ in range(2000):
            yield b"1," * 50
        yield b"1]}"

    r = client.post("/v1/lookup", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/lookup", content=b"{}", headers={**AUTH, "content-length": "abc"})
    assert r.status_code in (400, 413)
    assert client.get("/v1/health").status_code == 200


def test_too_many_keys_in_events(client):
    register(client, "a")
    app = create_app(MemoryIndex(), max_body_bytes=8 << 20)
    with TestClient(app) as c:
        register(c, "a")
        keys = ["ab" * 32] * 16385
        assert c.post("/v1/workers/a/events", json={"admit": {"cpu": keys}}).status_code == 422


def test_commands_on_unknown_or_unreachable_instances(client):
    tokens = list(range(8))
    r = client.post("/v1/move", json={"tokens": tokens, "src": "nope", "dst": "nope2", "dst_tier": "cpu"}, headers=AUTH)
    assert r.status_code == 404
    assert client.post("/v1/pin", json={"tokens": tokens, "instance": "nope"}, headers=AUTH).status_code == 404
    assert client.post("/v1/clear", json={"instance": "nope"}, headers=AUTH).status_code == 404
    register(client, "a", port=1)  # nothing listens on port 1
    register(client, "b", port=2)
    admit(client, "a", "cpu", keys_of(tokens))
    client.controller.peers.client_kw["connect_timeout_s"] = 0.3
    r = client.post("/v1/clear", json={"instance": "a"}, headers=AUTH)
    assert r.status_code == 200
    result = r.json()["instances"]["a"]
    assert result["ok"] is False and result["chunks"] == 2 and result["error"]  # index entries dropped anyway
    admit(client, "a", "cpu", keys_of(tokens))
    r = client.post("/v1/move", json={"tokens": tokens, "src": "a", "dst": "b", "dst_tier": "cpu"}, headers=AUTH)
    assert r.status_code == 502
    r = client.post("/v1/move", json={"tokens": tokens, "src": "a", "dst": "b", "dst_tier": "nvme"}, headers=AUTH)
    assert r.status_code == 400
    r = client.post("/v1/move", json={"tokens": tokens, "src": "a", "dst": "a", "dst_tier": "cpu"}, headers=AUTH)
    assert r.status_code == 400
    r = client.post("/v1/pin", json={"tokens": tokens}, headers=AUTH)
    assert r.status_code == 200 and r.json()["instances"]["a"]["ok"] is False


def test_metrics(client):
    register(client, "a")
    client.post("/v1/lookup", json={"tokens": list(range(8))}, headers=AUTH)
    client.post("/v1/lookup", json={"tokens": [-1]}, headers=AUTH)
    client.get("/v1/instances", headers=AUTH)
    text = client.get("/metrics", headers=AUTH).text
    assert 'kvfabric_controller_requests_total{route="/v1/lookup",status="200"} 1.0' in text
    assert 'kvfabric_controller_requests_total{route="/v1/lookup",status="422"} 1.0' in text
    assert "kvfabric_controller_lookups_total 1.0" in text
    assert "kvfabric_controller_instances 1.0" in text
    assert "kvfabric_controller_request_seconds_bucket" in text


def test_bind_rules():
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    with pytest.raises(ValueError, match="token"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "tok")
    assert main(["--host", "0.0.0.0", "--port", "1"]) == 2  # refuses to start without a token


@needs_redis
def test_redis_down_is_503_and_health_degraded(redis_server):  # noqa: F811
    app = create_app(RedisIndex(redis_server.url, timeout_s=0.3))
    with TestClient(app) as c:
        register(c, "a")
        assert c.post("/v1/lookup", json={"tokens": [1, 2, 3, 4]}).status_code == 200
        redis_server.stop()
        assert c.post("/v1/lookup", json={"tokens": [1, 2, 3, 4]}).status_code == 503
        assert c.post("/v1/workers/a/heartbeat", json={}).status_code == 503
        health = c.get("/v1/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        redis_server.start()
        assert c.post("/v1/lookup", json={"tokens": [1, 2, 3, 4]}).status_code == 200


# ---- fuzzing from the OpenAPI schema ------------------------------------------------------------------------
# Every built-in check (response schema, status codes, content types, negative data rejected, positive data
# accepted), with our bounds: 413 is a valid answer to any body over the size limit, and the only 5xx allowed is
# 502 (a worker the controller had to reach was not there; the fuzzer registers made-up workers).
FUZZ_APP = create_app(MemoryIndex(), token=TOKEN, instance_ttl_s=30, max_body_bytes=256 * 1024,
                      control_timeout_s=0.2, connect_timeout_s=0.1)
FUZZ_CONFIG = SchemathesisConfig.from_dict({"checks": {
    "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "502"]},
    "negative_data_rejection": {"expected-statuses": ["400", "401", "404", "413", "422", "502"]},
    "positive_data_acceptance": {"expected-statuses": ["2xx", "401", "404", "413", "502"]},
}})
schema = schemathesis.openapi.from_asgi("/openapi.json", FUZZ_APP, config=FUZZ_CONFIG)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_api_from_openapi_schema(case):
    case.call_and_validate(headers=AUTH)
