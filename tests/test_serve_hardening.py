"""`rollwise serve` under hostile or unlucky clients, over real HTTP (uvicorn thread, real TorchEngine):
clients that disconnect, an engine thread that dies, weight paths outside `serve.weights_root`, partial
weights, and the size limits (`serve.max_body_mb`, `max_prompts_per_request`, `max_weights_mb`,
`max_weight_uploads`)."""

from __future__ import annotations

import copy
import os
import socket
import threading
import time

import httpx
import pytest
import torch
from helpers_model import tiny_llama
from safetensors.torch import save, save_file
from test_serve import KEY, client, start, tiny  # noqa: F401  (tiny: the module's tiny model fixture)

from rollwise.generate.torch_engine import TorchEngine
from rollwise.serve.jobs import Worker
from rollwise.serve.weights import PATH_REFUSED
from rollwise.types import GenerationRequest, SamplingParams, Status



@pytest.fixture
def served(tiny, request):
    """A fresh server per test; `@pytest.mark.parametrize("served", [{serve options}], indirect=True)`."""
    service, server = start(tiny, **getattr(request, "param", {}))
    yield service, server
    server.stop()
    service.worker.close()


def spy_generate(engine, hold=None) -> list[tuple[list, list]]:
    """Record each `engine.generate` call as it starts: (its prompts, its results once it returns); the real
    engine still runs, after `hold()` returns when given (the first call only)."""
    calls: list[tuple[list, list]] = []
    real = engine.generate

    def generate(requests, on_finish=None):
        call: tuple[list, list] = ([list(r.prompt_ids) for r in requests], [])
        calls.append(call)
        if hold is not None and len(calls) == 1:
            hold()
        call[1].extend(real(requests, on_finish=on_finish))
        return call[1]

    engine.generate = generate
    return calls


def raw_http(port: int, head: str, body: bytes = b"") -> str:
    """Send one request over a plain socket; the status line and headers of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        return sock.recv(65536).decode(errors="replace")


# -- clients that go away, a worker that dies -------------------------------------------------------------------


def until_abandoned(service, count: int = 1, timeout_s: float = 30.0):
    """A `hold` for `spy_generate`: wait until the server has noticed `count` clients gone."""

    def hold():
        deadline = time.monotonic() + timeout_s
        while service.worker.counters["abandoned"] < count and time.monotonic() < deadline:
            time.sleep(0.01)

    return hold


def test_a_client_that_disconnects_is_aborted_and_the_next_request_runs(served):
    service, server = served
    # the engine call starts once the server noticed the client gone: its sequence must come back aborted
    calls = spy_generate(service.worker.engine, hold=until_abandoned(service))
    body = {"prompt": [5, 6], "max_tokens": 200, "temperature": 1.0, "seed": 1}
    with pytest.raises(httpx.TimeoutException):
        client(server).post("/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 60
    while not calls or not calls[0][1]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    [gone] = calls[0][1]
    assert service.worker.counters["abandoned"] == 1
    assert gone.status == Status.ABORTED and gone.response_ids == []  # never decoded for a client that left
    r = client(server).post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_queued_request_whose_client_left_never_runs(served):
    service, server = served
    # the first engine call waits until the queued request's client has left
    calls = spy_generate(service.worker.engine, hold=until_abandoned(service))
    answers = {}
    running = threading.Thread(target=lambda: answers.setdefault("first", client(server).post(
        "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4})))
    running.start()
    deadline = time.monotonic() + 30
    while not calls:  # the first one runs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(httpx.TimeoutException):  # queued behind it, then gone
        client(server).post("/v1/completions", json={"prompt": [9, 9, 9], "max_tokens": 4}, timeout=0.3)
    running.join(60)
    assert answers["first"].status_code == 200
    r = client(server).post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 2})
    assert r.status_code == 200
    assert [prompts for prompts, _ in calls] == [[[5, 6]], [[7, 8]]]  # [9, 9, 9] never reached the engine


def test_a_cancelled_future_never_stops_the_worker(tiny):
    """What asyncio.wrap_future does when its handler is cancelled: cancel the future while it is queued. The
    worker skips it and goes on (it used to die on `set_result` of a cancelled future)."""
    model, tok = tiny
    engine = TorchEngine(model, tok, max_batch_size=64)
    released = threading.Event()
    calls = spy_generate(engine, hold=lambda: released.wait(30))
    worker = Worker(engine, tok)
    try:
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
        first = worker.submit_completion([GenerationRequest(0, [5, 6], params)])
        deadline = time.monotonic() + 30
        while not calls:  # `first` runs (held): the next ones queue behind it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = worker.submit_completion([GenerationRequest(0, [5, 7], params)])
        assert second.future.cancel()
        third = worker.submit_completion([GenerationRequest(0, [5, 8], SamplingParams(max_new_tokens=2))])
        released.set()
        assert len(first.future.result(60)[0]) == 1 and len(third.future.result(60)[0]) == 1
        assert [prompts for prompts, _ in calls] == [[[5, 6]], [[5, 8]]]
        assert worker.failure() is None
    finally:
        worker.close()


class Fatal(BaseException):
    """An engine failure below Exception (what ends a thread: SystemExit from a C extension, ...)."""


def test_a_dead_engine_thread_fails_requests_and_health_says_so(served):
    service, server = served
    engine = service.worker.engine

    def broken(requests, on_finish=None):
        raise Fatal("the device is gone")

    engine.generate = broken
    r = client(server).post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "Fatal: the device is gone" in r.json()["error"]["message"]
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert "Fatal: the device is gone" in health.json()["error"]["message"]
    r = client(server).post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "restart" in r.json()["error"]["message"]


def test_an_engine_bug_fails_only_its_own_request(served):
    service, server = served
    engine = service.worker.engine
    real = engine.generate
    engine.generate = lambda requests, on_finish=None: real(requests, on_finish)[:-1]  # one result lost
    r = client(server).post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "n": 2}, timeout=30)
    assert r.status_code == 500 and "no result for 1 of this request's 2 sequences" in r.json()["error"]["message"]
    engine.generate = real
    r = client(server).post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and httpx.get(server.url + "/health").json()["status"] == "ok"


def test_nan_and_infinite_numbers_are_refused(served):
    _, server = served
    for text in ('{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "temperature": Infinity}'):
        r = client(server).post("/v1/completions", content=text, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not a JSON number" in r.json()["error"]["message"], r.text
    r = client(server).post("/v1/completions", content='{"prompt": "hi", "temperature": 1e999}',
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "temperature must be a finite number" in r.json()["error"]["message"]


# -- weights: a root for paths, whole state dicts ---------------------------------------------------------------


def weights_of(model) -> dict:
    return {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.fixture
def weight_tree(tmp_path, tiny):
    """root/ with a good file and folder, and next to it outside/ with a good file; links and odd files."""
    model, tok = tiny
    other = tiny_llama(len(tok), seed=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "v1").mkdir(parents=True)
    outside.mkdir()
    save_file(weights_of(other), root / "good.safetensors")
    save_file(weights_of(other), root / "v1" / "model.safetensors")
    save_file(weights_of(other), outside / "model.safetensors")
    (root / "notes.txt").write_text("not weights")
    (root / "empty").mkdir()
    os.symlink(outside / "model.safetensors", root / "link.safetensors")
    os.symlink(outside, root / "linkdir")
    return root, outside


@pytest.mark.parametrize("served", [{}], indirect=True)
def test_weight_paths_are_off_without_a_root(served, weight_tree):
    service, server = served
    root, _ = weight_tree
    r = client(server).post("/v1/weights", json={"path": str(root / "good.safetensors"), "version": 1})
    assert r.status_code == 400 and "serve.weights_root is unset" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["policy_version"] == 0


def test_weight_paths_load_only_under_the_root_and_every_refusal_reads_the_same(tiny, weight_tree):
    root, outside = weight_tree
    model, tok = tiny
    service, server = start((copy.deepcopy(model), tok), weights_root=root)  # the module's model stays as it is
    try:
        http = client(server)
        refused = [outside / "model.safetensors", root / ".." / "outside" / "model.safetensors",
                   "../outside/model.safetensors", root / "link.safetensors", root / "linkdir",
                   root / "missing.safetensors", root / "notes.txt", root / "empty", "/etc/passwd", "/etc",
                   "/nonexistent/x.safetensors", "a\x00b"]
        answers = {(r.status_code, r.json()["error"]["message"])
                   for r in (http.post("/v1/weights", json={"path": str(p), "version": 7}) for p in refused)}
        assert answers == {(400, PATH_REFUSED)}
        assert http.get("/health").json()["policy_version"] == 0
        for version, path in enumerate([root / "good.safetensors", "v1", "good.safetensors"], start=1):
            r = http.post("/v1/weights", json={"path": str(path), "version": version})
            assert r.status_code == 200 and r.json()["policy_version"] == version, r.text
    finally:
        server.stop()
        service.worker.close()


def test_a_partial_state_dict_is_refused_and_the_version_stays(tiny, served):
    model, _ = tiny
    service, server = served
    state = weights_of(model)
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    assert 0 < len(partial) < len(state)
    r = client(server).post("/v1/weights?version=5", content=save(partial),
                            headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "missing from the state dict" in message and "model.layers.1." in message
    assert httpx.get(server.url + "/health").json()["policy_version"] == 0
    bad = dict(state, **{"model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))})
    r = client(server).post("/v1/weights?version=5", content=save(bad))
    assert r.status_code == 400 and "'model.norm.weight' holds NaN" in r.json()["error"]["message"]
    assert client(server).post("/v1/weights?version=5", content=save(state)).json()["policy_version"] == 5


# -- size limits ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("served", [{"max_body_mb": 0.01}], indirect=True)  # 10485 bytes
def test_a_body_over_max_body_mb_gets_413_before_it_is_read(served):
    _, server = served
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
    answer = raw_http(server.port, head, b'{"prompt": "hi"')  # 1 GB announced, 15 bytes sent
    assert answer.startswith("HTTP/1.1 413") and "serve.max_body_mb = 0.01 MB" in answer, answer
    big = b'{"prompt": "' + b"x" * 20000 + b'"}'
    r = client(server).post("/v1/completions", content=iter([big[:8000], big[8000:]]),  # chunked: no length
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "over 10485 bytes received" in r.json()["error"]["message"]
    message = r.json()["error"]["message"]
    assert "\n" not in message
    r = client(server).post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize("served", [{"max_prompts_per_request": 2}], indirect=True)
def test_too_many_prompts_get_413(served):
    _, server = served
    http = client(server)
    r = http.post("/v1/completions", json={"prompt": [[5], [6], [7]], "max_tokens": 2})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == ("prompt holds 3 prompts, over serve.max_prompts_per_request = 2: "
                                            "split the request")
    r = http.post("/v1/episodes", json={"env": "calc", "prompts": [{"prompt": "x"}] * 3})
    assert r.status_code == 413 and "prompts holds 3 prompts" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": [[5], [6]], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("served", [{"max_weight_uploads": 1, "max_weights_mb": 1}], indirect=True)
def test_weight_uploads_in_flight_and_size_are_bounded(tiny, served):
    model, _ = tiny
    service, server = served
    data = save(weights_of(model))
    assert len(data) < 2**20
    release, answers = threading.Event(), {}

    def slow_body():
        yield data[:1000]
        release.wait(30)
        yield data[1000:]

    def upload():
        answers["first"] = client(server).post("/v1/weights?version=2", content=slow_body())

    first = threading.Thread(target=upload)
    first.start()
    deadline = time.monotonic() + 30
    while service.weight_uploads == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = client(server).post("/v1/weights?version=3", content=data)
    assert r.status_code == 429 and "serve.max_weight_uploads = 1" in r.json()["error"]["message"]
    release.set()
    first.join(60)
    assert answers["first"].status_code == 200 and answers["first"].json()["policy_version"] == 2
    r = client(server).post("/v1/weights?version=3", content=data + b"\0" * 2**20)
    assert r.status_code == 413 and "serve.max_weights_mb = 1 MB" in r.json()["error"]["message"]
    assert client(server).post("/v1/weights?version=3", content=data).json()["policy_version"] == 3
