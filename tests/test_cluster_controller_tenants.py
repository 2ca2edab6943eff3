"""The controller's calls scoped to the caller's token's tenants (issue #38): a tenant token finds and touches only
chunks keyed in its own tenants' namespaces, derived from each instance's namespace wire form."""
from __future__ import annotations

import logging
import os

import pytest
from fastapi.testclient import TestClient

from kvfabric.cluster.controller import main
from kvfabric.cluster.controller_app import create_app
from kvfabric.cluster.controller_tenants import Caller, TenantTokens
from kvfabric.cluster.index import Namespace
from kvfabric.cluster.index_memory import MemoryIndex
from kvfabric.kv.hashing import KeySpace
from kvfabric.kv.layout import KVLayout

TOKEN = "cluster-token"
ACME, GLOBEX, BOTH = "acme-token", "globex-token", "both-token"
SPACE = KeySpace.of("m", KVLayout(2, 2, 8, "float16"), 4)  # what the instance registers (its wire form below)
PROMPT = list(range(16))  # 4 chunks


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def client(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"acme: {ACME}\nglobex: {GLOBEX}\nacme-staging: {BOTH}\ninitech: {BOTH}\n")
    path.chmod(0o600)
    app = create_app(MemoryIndex(), token=TOKEN, instance_ttl_s=30, control_timeout_s=0.2, connect_timeout_s=0.1,
                     tenants=TenantTokens.load(path, TOKEN))
    with TestClient(app) as c:
        ns = Namespace.of(SPACE)
        body = {"instance_id": "w1", "host": "127.0.0.1", "port": 9, "tiers": [{"name": "cpu"}],
                "namespaces": [{"model_id": ns.model_id, "root": ns.root, "chunk_size": ns.chunk_size}]}
        assert c.post("/v1/workers/register", json=body, headers=auth(TOKEN)).status_code == 200
        # the worker holds acme's copy of the prompt (3 chunks of 4) and the shared namespace's first chunk
        acme_keys = SPACE.tenant("acme").keys(PROMPT)[:3]
        events = {"admit": {"cpu": [k.hex() for k in acme_keys + SPACE.keys(PROMPT)[:1]]}}
        assert c.post("/v1/workers/w1/events", json=events, headers=auth(TOKEN)).json()["known"]
        yield c


def prefix(client, token, **extra):
    r = client.post("/v1/lookup", json={"tokens": PROMPT, **extra}, headers=auth(token))
    assert r.status_code == 200, r.text
    return [h["prefix_chunks"] for h in r.json()["instances"]]


def test_a_tenant_token_finds_only_its_tenants_chunks(client):
    assert prefix(client, ACME) == [3]
    assert prefix(client, GLOBEX) == [0]  # the same prompt, another tenant: nothing
    assert prefix(client, BOTH) == [0]  # acme-staging and initech: neither is acme
    assert prefix(client, TOKEN) == [1]  # the operator: the shared namespace by default ...
    assert prefix(client, TOKEN, tenant="acme") == [3]  # ... or any tenant's
    assert prefix(client, ACME, tenant="acme") == [3]


def test_a_tenant_token_cannot_name_another_tenant_keys_or_operator_routes(client):
    for body in ({"tokens": PROMPT, "tenant": "acme"}, {"keys": [SPACE.tenant("acme").keys(PROMPT)[0].hex()]}):
        r = client.post("/v1/lookup", json=body, headers=auth(GLOBEX))
        assert r.status_code == 403, r.text
    assert client.post("/v1/pin", json={"tokens": PROMPT, "tenant": "acme"}, headers=auth(BOTH)).status_code == 403
    move = {"tokens": PROMPT, "src": "w1", "dst": "w1", "dst_tier": "cpu", "tenant": "acme"}
    assert client.post("/v1/move", json=move, headers=auth(GLOBEX)).status_code == 403
    for method, path in [("get", "/v1/instances"), ("get", "/metrics"), ("get", "/v1/history"),
                         ("post", "/v1/clear"), ("post", "/v1/workers/register"), ("delete", "/v1/workers/w1")]:
        r = getattr(client, method)(path, headers=auth(ACME), **({"json": {}} if method == "post" else {}))
        assert r.status_code == 403, (path, r.status_code)
    assert client.get("/ui", headers=auth(ACME)).status_code == 401
    assert client.get("/v1/instances", headers=auth(TOKEN)).status_code == 200


def test_a_tenant_pins_only_its_own_chunks(client):
    # globex's pin of acme's prompt selects no chunk of globex's: the worker is never asked (it is unreachable,
    # so asking it would be a failed result)
    r = client.post("/v1/pin", json={"tokens": PROMPT}, headers=auth(GLOBEX))
    assert r.status_code == 200 and r.json() == {"instances": {}}, r.text
    r = client.post("/v1/pin", json={"tokens": PROMPT}, headers=auth(ACME))  # acme's: the worker is asked
    assert r.status_code == 200 and r.json()["instances"]["w1"]["ok"] is False, r.text


def test_tenant_tokens_file_errors_are_one_line(tmp_path, caplog, capsys):
    path = tmp_path / "t.yaml"
    for text, match in [("- a\n", "mapping of tenant name"), ("acme: ''\n", "non-empty token"),
                        (f"acme: {TOKEN}\n", "has the cluster token"), ("acme: [\n", "not valid YAML"),
                        ("123: x\n", "quote 123")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=match) as info:
            TenantTokens.load(path, TOKEN)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="need the cluster token"):
        path.write_text("acme: x\n")
        TenantTokens.load(path, None)
    with pytest.raises(ValueError, match="No such file"):
        TenantTokens.load(tmp_path / "missing.yaml", TOKEN)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        tokens = TenantTokens.load(path, TOKEN)
    assert "chmod 600" in caplog.text
    assert tokens.identify(b"x", TOKEN) == Caller(is_admin=False, tenants=frozenset({"acme"}))
    assert tokens.identify(TOKEN.encode(), TOKEN) == Caller.ADMIN and tokens.identify(b"y", TOKEN) is None
    # the command line: one line naming the file, exit 2, for the tenants file and the token file alike
    os.environ.pop("KVFABRIC_CLUSTER__TOKEN", None)
    assert main(["--port", "0", "--tenant-tokens", str(tmp_path / "missing.yaml")]) == 2
    assert main(["--port", "0", "--token-file", str(tmp_path / "no-token")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "missing.yaml" in err[0] and "no-token" in err[1], err
