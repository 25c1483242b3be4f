"""GenerationProcess: a TorchEngine in a spawned child; weights through shared memory; every shutdown path.

Real processes, no mocks. Spawn start-up (importing torch and transformers) is the slow part, so one child is
shared by the tests that leave it alive (`shared`), and the two Ctrl-C / kill -9 scripts boot together.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from torch.testing import assert_close

from conftest import TESTS_DIR, subprocess_env
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate import GenerationProcess, TorchEngine
from rollwise.generate.process import GenerationProcessError
from rollwise.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
TEXTS = ["What is 7 + 3?", "Compute 12 - 5.", "How many letters are in the word 'banana'?", "the answer is"]
REPO = TESTS_DIR.parent


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an unreaped zombie counts as gone: it runs nothing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _model(tok, seed=0):
    """Tied embeddings; a larger init than the default, whose greedy output repeats the last prompt token
    whatever the weights."""
    return tiny_llama(len(tok), seed=seed, initializer_range=0.2, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def model(tok):
    return _model(tok)


@pytest.fixture(scope="module")
def shared_process(model, tok):
    proc = GenerationProcess(model, tok, threads=1, max_batch_size=8)
    yield proc
    proc.close()
    assert not _alive(proc.pid)


@pytest.fixture
def shared(shared_process, model):
    """The module's child, holding `model`'s weights (pushed back if an earlier test changed them)."""
    if shared_process.version > 0:
        shared_process.push_weights(dict(model.named_parameters()), shared_process.version + 1)
    return shared_process


def _requests(tok, params=GREEDY):
    return [GenerationRequest(i, tok(t, add_special_tokens=False).input_ids, params) for i, t in enumerate(TEXTS)]


def _assert_same(got, want):
    """Same tokens and statuses, logprobs within 1e-5."""
    assert [r.request_id for r in got] == [r.request_id for r in want]
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids and g.status == w.status
        assert_close(g.logprobs, w.logprobs, atol=1e-5, rtol=0)


def test_greedy_matches_in_process_engine(shared, model, tok):
    reqs = _requests(tok)
    shared.submit(7, reqs[:2])
    shared.submit(8, reqs[2:])
    assert shared.pending == 2
    first, second = shared.receive(timeout=60), shared.receive(timeout=60)  # FIFO
    assert (first.ticket, second.ticket, shared.pending) == (7, 8, 0)
    _assert_same(first.results + second.results, TorchEngine(model, tok).generate(reqs))
    assert first.version == shared.version
    assert first.stats["generated_tokens"] == sum(len(r.response_ids) for r in first.results)
    assert first.generate_s > 0


def test_push_weights_changes_the_childs_output(shared, model, tok):
    other = _model(tok, seed=1)
    reqs = _requests(tok)
    expected = TorchEngine(other, tok).generate(reqs)
    assert [r.response_ids for r in expected] != [r.response_ids for r in TorchEngine(model, tok).generate(reqs)]
    version = shared.version + 1  # 1 when the file runs in order
    shared.push_weights(dict(other.named_parameters()), version)
    shared.submit(0, reqs)
    done = shared.receive(timeout=60)
    assert done.version == version == shared.version
    _assert_same(done.results, expected)
    assert all(r.version_spans == [(0, len(r.response_ids), version)] for r in done.results if r.response_ids)


def test_min_version_waits_for_the_push(shared, model, tok):
    reqs = _requests(tok)[:1]
    version = shared.version + 1
    shared.submit(1, reqs, min_version=version)
    with pytest.raises(TimeoutError):
        shared.receive(timeout=0.5)
    other = _model(tok, seed=2)
    shared.push_weights(other.state_dict(), version)  # state_dict(): the tied 'lm_head.weight' is an alias
    done = shared.receive(timeout=60)
    assert done.ticket == 1 and done.version == version
    _assert_same(done.results, TorchEngine(other, tok).generate(reqs))


def test_push_weights_validates_before_writing(shared, model):
    state = dict(model.named_parameters())
    before = shared._flat.clone()
    with pytest.raises(KeyError, match="not.a.weight"):
        shared.push_weights({**state, "not.a.weight": state["model.norm.weight"]}, shared.version + 1)
    with pytest.raises(ValueError, match="model.norm.weight"):
        shared.push_weights({**state, "model.norm.weight": state["model.norm.weight"][:-1]}, shared.version + 1)
    with pytest.raises(ValueError, match="greater"):
        shared.push_weights(state, shared.version)
    assert shared._flat.is_shared() and shared._flat.equal(before)
    with pytest.raises(RuntimeError, match="no ticket pending"):
        shared.receive(timeout=0.1)


def test_child_exception_is_raised_in_the_parent_and_the_child_exits(model, tok):
    proc = GenerationProcess(model, tok)
    pid = proc.pid
    proc.submit(0, [GenerationRequest(0, [len(tok) + 5], GREEDY)])  # token id >= vocab: the embedding raises
    with pytest.raises(GenerationProcessError) as err:
        proc.receive(timeout=60)
    assert "IndexError" in str(err.value) and "index out of range" in str(err.value)
    assert "Traceback" in str(err.value)
    assert not _alive(pid)
    with pytest.raises(GenerationProcessError, match="closed"):
        proc.submit(1, _requests(tok))


def test_close_is_idempotent_and_the_context_manager_closes_on_exception(model, tok):
    with pytest.raises(ZeroDivisionError):
        with GenerationProcess(model, tok) as proc:
            pid = proc.pid
            assert _alive(pid) and pid != os.getpid()
            os.kill(pid, signal.SIGINT)  # ignored by the child: the parent owns shutdown
            time.sleep(0.3)
            assert _alive(pid)
            1 / 0
    assert not _alive(pid)
    proc.close()
    proc.close()


def test_a_killed_child_is_reported(model, tok):
    with GenerationProcess(model, tok) as proc:
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(GenerationProcessError, match="exit code -9"):
            proc.submit(0, _requests(tok))
            proc.receive(timeout=60)
    assert not _alive(proc.pid)


SCRIPT = """
from helpers_model import tiny_llama
from helpers_tokenizer import tiny_tokenizer
from rollwise.generate.process import GenerationProcess
from rollwise.types import GenerationRequest, SamplingParams

tok = tiny_tokenizer()
model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
proc = GenerationProcess(model, tok)  # no `with`: on Ctrl-C the atexit hook must close it
print(proc.pid, flush=True)
for ticket in range(10**9):
    proc.submit(ticket, [GenerationRequest(0, [5, 6, 7], SamplingParams(max_new_tokens=8))])
    proc.receive(timeout=60)
    if ticket == 0:
        print("looping", flush=True)
"""


@pytest.fixture(scope="module")
def looping_scripts():
    """Two scripts that each start a GenerationProcess and generate forever (booted together: start-up is slow).
    Yields [(Popen, child pid)]."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    started = []
    try:
        for p in procs:
            pid_line, looping = p.stdout.readline(), p.stdout.readline()
            assert looping.strip() == "looping", p.stderr.read() if p.poll() is not None else pid_line
            started.append((p, int(pid_line)))
        yield started
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def test_ctrl_c_in_the_parent_stops_the_child(looping_scripts):
    script, child = looping_scripts[0]
    assert _alive(child)
    script.send_signal(signal.SIGINT)
    script.wait(timeout=30)
    assert "KeyboardInterrupt" in script.stderr.read()
    assert not _alive(child)


def test_the_child_exits_when_the_parent_is_killed(looping_scripts):
    script, child = looping_scripts[1]
    assert _alive(child)
    script.kill()  # SIGKILL: no atexit, no close()
    script.wait(timeout=30)
    assert _wait_gone(child, 15.0)
