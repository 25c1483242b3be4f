"""The agent endpoint (rollwise.agents.server) over real HTTP (uvicorn in a thread) against hostile callers: an
unknown key is refused (401) before a byte of the body is read, however large it is announced or streamed; a
known key's body is capped at `agent.max_body_mb` (413) by its Content-Length and, chunked, as it streams in,
reading no further; a normal call goes through."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future

import httpx
import pytest

from rollwise.agents.server import RUN_KEY_HEADER, LoopbackServer, create_app

KEY = "rw-ep-good"
CAP_MB = 0.01  # 10485 bytes
LIMIT = int(CAP_MB * 2**20)


@pytest.fixture
def endpoint():
    """(port, the bodies `submit` received): a loopback endpoint that knows KEY and answers every call with
    200 {"echo": model}."""
    seen: list = []

    def submit(key, model, session, body) -> Future:
        seen.append(body)
        future: Future = Future()
        future.set_result((200, {"echo": model}))
        return future

    server = LoopbackServer(create_app(submit, "rollwise", lambda key: key == KEY, CAP_MB))
    yield int(server.url.rsplit(":", 1)[1].split("/")[0]), seen
    server.stop()


def raw(port: int, head: str, body: bytes = b"", timeout_s: float = 10.0) -> str:
    """Send the head and the first bytes of a body that is never finished; the answer's first bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + body)
        try:
            return sock.recv(65536).decode(errors="replace")
        except socket.timeout:
            return "(no answer: the server waits for the rest of the body)"


def head(key_header: str, length: str = "", chunked: bool = False) -> str:
    framing = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{key_header}Content-Type: application/json\r\n"
            f"{framing}\r\n")


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.mark.parametrize("key_header", ["", "Authorization: Bearer wrong\r\n", f"{RUN_KEY_HEADER}: wrong\r\n"],
                         ids=["no key", "wrong bearer", "wrong run key"])
def test_an_unknown_key_gets_401_before_the_body_is_read(endpoint, key_header):
    port, seen = endpoint
    # 10 GB announced, 1 KB sent: the answer comes without the server waiting for (or holding) the rest
    answer = raw(port, head(key_header, length=str(10 * 2**30)), b"x" * 1024)
    assert answer.startswith("HTTP/1.1 401"), answer
    assert "unknown API key" in answer
    # chunked, never finished: the same
    answer = raw(port, head(key_header, chunked=True), chunk(b"y" * 4096))
    assert answer.startswith("HTTP/1.1 401"), answer
    assert seen == []


def test_a_known_key_with_a_body_over_max_body_mb_gets_413(endpoint):
    port, seen = endpoint
    bearer = f"Authorization: Bearer {KEY}\r\n"
    answer = raw(port, head(bearer, length=str(10 * 2**30)), b'{"model": "m"')  # by Content-Length, unread
    assert answer.startswith("HTTP/1.1 413"), answer
    assert "agent.max_body_mb = 0.01 MB" in answer
    # chunked: refused once the bytes received pass the cap, without waiting for the end of the body
    answer = raw(port, head(bearer, chunked=True), chunk(b"z" * 8000) + chunk(b"z" * 8000))
    assert answer.startswith("HTTP/1.1 413"), answer
    assert f"over {LIMIT} bytes received" in answer
    # a chunked body over the cap sent whole through a client: 413, one line
    big = b'{"model": "m", "messages": "' + b"x" * 20000 + b'"}'
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=iter([big[:8000], big[8000:]]),
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413 and "\n" not in r.json()["error"]["message"]
    assert seen == []


def test_a_normal_call_and_the_run_key_header_go_through(endpoint):
    port, seen = endpoint
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "rw-ep-x", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}).json() == {"echo": "rw-ep-x"}
    # a client configured once (verifiers) sends Bearer EMPTY and the key in its own header
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer EMPTY", RUN_KEY_HEADER: KEY})
    assert r.status_code == 200 and len(seen) == 2
    r = httpx.post(url, content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400


def test_the_runner_checks_episode_and_run_keys_before_the_body(tmp_path):
    """The endpoint a real `AgentRunner` starts: its run key passes the key check (the body is then capped at
    the run's `agent.max_body_mb`), an unknown key does not."""
    from helpers_tokenizer import tiny_tokenizer

    from rollwise.agents.runner import AgentRunner
    from rollwise.config import AgentConfig

    runner = AgentRunner(lambda task, client: None, tiny_tokenizer(), AgentConfig(max_body_mb=CAP_MB), None, 8)
    runner._start()
    try:
        port = int(runner.url.rsplit(":", 1)[1].split("/")[0])
        answer = raw(port, head("Authorization: Bearer rw-ep-unknown\r\n", length=str(2**34)), b"x" * 100)
        assert answer.startswith("HTTP/1.1 401"), answer
        answer = raw(port, head(f"{RUN_KEY_HEADER}: {runner.run_key}\r\n", length=str(2**34)), b"x" * 100)
        assert answer.startswith("HTTP/1.1 413") and "agent.max_body_mb" in answer, answer
        r = httpx.post(runner.url + "/chat/completions", json={"model": "rw-ep-gone", "messages": []},
                       headers={RUN_KEY_HEADER: runner.run_key})
        assert r.status_code == 401  # read, then no such episode
        assert runner.run_key not in answer + r.text
    finally:
        runner.close()
    assert not [t for t in threading.enumerate() if t.name == "rollwise-agent-endpoint"]
