"""`kvfabric pd-proxy` against two stand-in OpenAI servers on 127.0.0.1 (the real vLLM pair: test_pd_vllm.py):
the prefill instance gets max_tokens=1 without streaming, then the decode instance the request as sent; the
decode answer comes back as JSON or as its event stream; a dead prefill instance costs a recompute, not an error."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from kvfabric.bench.vllm_server import free_port
from kvfabric.pd.proxy import base_url, make_app, prefill_body


def _backend(name: str, seen: list[tuple[str, dict]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append((name, body))
        words = [f"{name}-{i}" for i in range(body["max_tokens"])]
        if body.get("stream"):
            def events() -> Iterator[bytes]:
                for word in words:
                    yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"text": " ".join(words)}]}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": name}]}

    return app


@pytest.fixture
def backends() -> Iterator[tuple[str, str, list]]:
    seen: list[tuple[str, dict]] = []
    servers, threads, urls = [], [], []
    for name in ("prefill", "decode"):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(_backend(name, seen), host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
        urls.append(f"http://127.0.0.1:{port}/v1")
    for url in urls:  # wait until each answers
        for _ in range(200):
            try:
                httpx.get(f"{url}/models", timeout=1)
                break
            except httpx.HTTPError:
                threading.Event().wait(0.02)
    yield urls[0], urls[1], seen
    for server, thread in zip(servers, threads):
        server.should_exit = True
        thread.join(timeout=10)


def test_prefill_gets_one_token_then_decode_answers(backends):
    prefill, decode, seen = backends
    with TestClient(make_app(prefill, decode)) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["text"] == "decode-0 decode-1 decode-2"
        assert [(name, body["max_tokens"]) for name, body in seen] == [("prefill", 1), ("decode", 3)]
        assert seen[0][1]["prompt"] == seen[1][1]["prompt"] == "hi"
        assert client.get("/v1/models").json()["data"][0]["id"] == "decode"
        assert client.get("/pd/stats").json()["prefills"] == 1


def test_streamed_answer_is_the_decode_stream(backends):
    prefill, decode, seen = backends
    with TestClient(make_app(prefill, decode)) as client:
        with client.stream("POST", "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2,
                                                            "stream": True}) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]] == ["decode-0", "decode-1"]
    assert "stream" not in seen[0][1] and seen[1][1]["stream"] is True


def test_dead_prefill_instance_degrades_to_decode_only(backends):
    _, decode, seen = backends
    dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(make_app(dead, decode, prefill_timeout_s=5)) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert reply.json()["choices"][0]["text"] == "decode-0 decode-1"
        assert client.get("/pd/stats").json()["prefill_failures"] == 1
    assert [name for name, _ in seen] == ["decode"]


def test_helpers():
    assert base_url("http://h:1/v1/") == base_url("http://h:1") == "http://h:1"
    body = {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 9, "stream": True, "stream_options": {}}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1}
    with TestClient(make_app("http://127.0.0.1:1", "http://127.0.0.1:1")) as client:
        assert client.post("/v1/completions", json=[1]).status_code == 400
