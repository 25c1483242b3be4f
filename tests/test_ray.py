"""Ray placement: engine workers as actors behind the engine contract, failures, and a clean shutdown.

One local Ray cluster for the module (3 engine bundles + 1 trainer-rank bundle of 1 logical CPU each): a
2-worker engine on bundles 0-1 shared by the tests, bundle 2 for the engine the failure test kills. The Ctrl-C
test starts its own cluster in a subprocess.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

import torch  # noqa: E402

from helpers_model import tiny_llama  # noqa: E402
from helpers_tokenizer import tiny_tokenizer  # noqa: E402
from conftest import tiny_config  # noqa: E402
from rollwise.cluster import (Cluster, EngineSpec, RemoteEngine, WorkerError, split_requests,  # noqa: E402
                              start_trainer_ranks)
from rollwise.config import ClusterConfig  # noqa: E402
from rollwise.generate.torch_engine import TorchEngine  # noqa: E402
from rollwise.models import load_model  # noqa: E402
from rollwise.models.probe import model_probe_logprobs  # noqa: E402
from rollwise.types import GenerationRequest, Prompt, Sample, SamplingParams, Status  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def model_and_tok():
    tok = tiny_tokenizer()
    return tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), tok


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("ray-run")
    with Cluster(ClusterConfig(ray=True, engine_workers=3, resources={"CPU": 1.0}), train_world_size=2,
                 log_dir=log_dir) as c:
        yield c


@pytest.fixture(scope="module")
def engine(cluster, tiny_model_dir):
    spec = EngineSpec("torch", str(tiny_model_dir), str(tiny_model_dir), max_batch_size=8)
    with RemoteEngine(cluster, spec, bundles=[0, 1]) as e:
        yield e


def requests_for(tok, texts: list[str], per_prompt: int, params: SamplingParams, first_id: int = 0):
    prompts = [tok(t)["input_ids"] for t in texts]
    return [GenerationRequest(first_id + i * per_prompt + j, p, params)
            for i, p in enumerate(prompts) for j in range(per_prompt)]


def test_split_keeps_prompts_together_and_balances():
    p = SamplingParams()
    reqs = [GenerationRequest(i, ids, p) for i, ids in enumerate([[1], [2], [2], [1], [3], [2], [3]])]
    shares = split_requests(reqs, 2)
    # groups: [2] x3 -> worker 0 (3), [1] x2 -> worker 1 (2), [3] x2 -> worker 1 (4); call order kept
    assert [[r.request_id for r in s] for s in shares] == [[1, 2, 5], [0, 3, 4, 6]]
    assert split_requests(reqs[:1], 3)[1:] == [[], []]


def test_local_cluster_is_bound_to_loopback_and_logs_to_the_run(cluster, engine):
    assert {info["node"] for info in engine.infos} == {"127.0.0.1"}
    assert len({info["pid"] for info in engine.infos}) == 2 and os.getpid() not in {i["pid"] for i in engine.infos}
    assert ray.cluster_resources()["CPU"] == 4.0  # 3 engine bundles + rank 1 (rank 0 is this process)
    gcs = next(p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server")
    assert {c.laddr.ip for c in gcs.net_connections("inet") if c.status == "LISTEN"} <= {"127.0.0.1",
                                                                                            "::ffff:127.0.0.1"}


def test_two_workers_give_the_local_engines_greedy_tokens(engine, model_and_tok):
    model, tok = model_and_tok
    reqs = requests_for(tok, ["hello world", "one two three", "the cat", "a b c"], 3, GREEDY)
    engine.stats.reset()
    arrived = []
    remote = engine.generate(reqs, on_finish=lambda r: arrived.append(r.request_id))
    local = TorchEngine(model, tok, max_batch_size=8).generate(reqs)
    assert [r.request_id for r in remote] == [r.request_id for r in reqs]
    assert sorted(arrived) == sorted(r.request_id for r in reqs)
    assert [r.response_ids for r in remote] == [r.response_ids for r in local]
    assert [r.status for r in remote] == [r.status for r in local]
    for a, b in zip(remote, local):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        assert a.version_spans == [(0, len(a.response_ids), 0)]
    # summed stats; one prefill per prompt: the 3 samples of a prompt stayed on one worker
    assert engine.stats.generated_tokens == sum(len(r.response_ids) for r in remote)
    assert engine.stats.prefill_sequences == 4


def test_abort_from_on_finish_reaches_the_actors_and_continues(engine, model_and_tok):
    model, tok = model_and_tok
    long_params = SamplingParams(max_new_tokens=120, temperature=0.0)
    short = GenerationRequest(100, tok("x y")["input_ids"], SamplingParams(max_new_tokens=2, temperature=0.0))
    longs = requests_for(tok, ["hello world", "the cat"], 2, long_params)  # 2 prompts: one on each worker
    assert {len(s) for s in split_requests(longs + [short], 2)} == {2, 3}

    def on_finish(result):
        if result.request_id == short.request_id:
            engine.abort([r.request_id for r in longs])

    results = engine.generate(longs + [short], on_finish=on_finish)
    assert results[-1].status == Status.TRUNCATED and len(results[-1].response_ids) == 2
    aborted = results[:-1]
    assert all(r.status == Status.ABORTED for r in aborted), [r.status for r in aborted]
    assert all(0 < len(r.response_ids) < 120 for r in aborted)
    # continue the aborted ones to the end: the tokens are those of one uninterrupted greedy run
    again = [GenerationRequest(r.request_id + 10, q.prompt_ids, long_params, response_ids=list(r.response_ids),
                               response_logprobs=list(r.logprobs)) for q, r in zip(longs, aborted)]
    continued = engine.generate(again)
    straight = TorchEngine(model, tok, max_batch_size=8).generate(longs)
    assert [r.response_ids for r in continued] == [r.response_ids for r in straight]
    assert [r.status for r in continued] == [Status.TRUNCATED] * len(longs)
    assert [r.version_spans for r in continued] == [[(len(a.response_ids), 120, 0)] for a in aborted]


def test_early_abort_returns_at_once(engine, model_and_tok):
    _, tok = model_and_tok
    reqs = requests_for(tok, ["hello world"], 2, GREEDY, first_id=200)
    engine.abort([200])  # before the call: aborted on admission, as a local engine does
    results = engine.generate(reqs)
    assert (results[0].status, results[0].response_ids) == (Status.ABORTED, [])
    assert results[1].status == Status.TRUNCATED and len(results[1].response_ids) == GREEDY.max_new_tokens
    assert engine.generate(reqs[:1])[0].status == Status.TRUNCATED  # the abort did not linger


def test_update_weights_and_reload_change_the_outputs(engine, model_and_tok, tiny_model_dir, tmp_path):
    model, tok = model_and_tok
    other = tiny_llama(len(tok), seed=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    reqs = requests_for(tok, ["hello world", "one two three"], 2, GREEDY, first_id=300)
    probe = tok("the cat sat on the mat")["input_ids"]
    before = engine.generate(reqs)
    try:
        engine.update_weights(dict(other.named_parameters()), 5)
        assert engine.version == 5
        after = engine.generate(reqs)
        expected = TorchEngine(other, tok, max_batch_size=8).generate(reqs)
        assert [r.response_ids for r in after] == [r.response_ids for r in expected]
        for a, b in zip(after, expected):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        # (greedy tokens of a random tiny model repeat the prompt's last token under both weights)
        assert max(abs(a - b) for r, q in zip(after, before) for a, b in zip(r.logprobs, q.logprobs)) > 0.1
        assert {s[2] for r in after for s in r.version_spans} == {5}
        torch.testing.assert_close(torch.tensor(engine.probe_logprobs(probe)),
                                   torch.tensor(model_probe_logprobs(other, probe)))
        engine.reload_from(tiny_model_dir, 6)  # the safetensors folder of the starting weights
        assert engine.version == 6
        reloaded = engine.generate(reqs)
        assert [r.response_ids for r in reloaded] == [r.response_ids for r in before]
        assert [r.logprobs for r in reloaded] == [r.logprobs for r in before]
    finally:
        engine.update_weights(dict(model.named_parameters()), 0)
    assert engine.version == 0


def test_failing_and_killed_engine_workers_give_one_clear_error(cluster, tiny_model_dir, model_and_tok):
    _, tok = model_and_tok
    spec = EngineSpec("torch", str(tiny_model_dir), str(tiny_model_dir), max_batch_size=8)
    lone = RemoteEngine(cluster, spec, bundles=[2])
    try:
        with pytest.raises(WorkerError, match=r"^engine worker 0 failed: .*KeyError: 'no_such_weight'") as err:
            lone.update_weights({"no_such_weight": torch.zeros(1)}, 1)
        assert 'torch_engine.py", line' in err.value.remote_traceback and "\n" not in str(err.value)
        pid = lone.infos[0]["pid"]
        reqs = requests_for(tok, ["hello world", "the cat"], 1, SamplingParams(max_new_tokens=2, temperature=0.0))
        reqs += requests_for(tok, ["a b c"], 2, SamplingParams(max_new_tokens=400, temperature=0.0), first_id=10)
        start = time.perf_counter()
        with pytest.raises(WorkerError, match=r"^engine worker 0 died: ") as err:
            lone.generate(reqs, on_finish=lambda r: os.kill(pid, signal.SIGKILL))  # dies mid-call
        assert "\n" not in str(err.value) and time.perf_counter() - start < 30
    finally:
        lone.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


SIGINT_SCRIPT = textwrap.dedent("""
    import sys
    from rollwise.cluster import Cluster, EngineSpec, RemoteEngine
    from rollwise.config import ClusterConfig
    from rollwise.types import GenerationRequest, SamplingParams

    if __name__ == "__main__":
        model_dir = sys.argv[1]
        with Cluster(ClusterConfig(ray=True, engine_workers=1), 1, log_dir=sys.argv[2]) as cluster:
            engine = RemoteEngine(cluster, EngineSpec("torch", model_dir, model_dir, max_batch_size=4))
            print("READY", flush=True)
            while True:  # the loop, generating, when Ctrl-C comes
                engine.generate([GenerationRequest(i, [5, 6, 7], SamplingParams(max_new_tokens=300))
                                 for i in range(4)])
""")


def test_ctrl_c_leaves_no_ray_process_behind(tiny_model_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(SIGINT_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir), str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", proc.stderr.read() if proc.poll() is not None else line
        time.sleep(1.0)  # inside a generate call
        started = psutil.Process(proc.pid).children(recursive=True)
        names = {_name(p) for p in started}
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::EngineWorker") for n in names), names
        os.kill(proc.pid, signal.SIGINT)  # only the driver: it must take the cluster down itself
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "KeyboardInterrupt" in stderr
    _, alive = psutil.wait_procs(started, timeout=5)
    assert not alive, [(p.pid, _name(p)) for p in alive]
    assert (tmp_path / "run" / "ray-logs").is_dir()


def test_placement_errors_name_what_was_asked_and_what_the_cluster_has(cluster):
    with pytest.raises(RuntimeError, match=r"cannot place .*'GPU': 2\.0\}? asked; the cluster has \{'CPU': 4"):
        Cluster(ClusterConfig(ray=True, engine_workers=2, resources={"CPU": 1.0, "GPU": 1.0}))
    with pytest.raises(RuntimeError, match=r"did not grant .* in 2 s: .*\(\{'CPU': 0\} free\)"):
        Cluster(ClusterConfig(ray=True, engine_workers=1), ready_timeout_s=2.0)  # every CPU is in the module's group
    assert ray.is_initialized()  # a cluster that joined the module's connection leaves it open


def _name(proc) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "gone"


def make_samples(vocab: int, groups: int = 3, seed: int = 0) -> list[Sample]:
    """Groups of 4 random samples (prompt 3-6 tokens, response 2-6) with advantages in [-1, 1]."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 6))]
        for _ in range(4):
            resp = [rng.randrange(4, vocab) for _ in range(rng.randint(2, 6))]
            out.append(Sample(Prompt(str(g), []), prompt, resp, [-3.0] * len(resp), [1] * len(resp),
                              Status.COMPLETED, g, advantage=rng.uniform(-1.0, 1.0)))
    return out


def test_trainer_rank_actor_trains_with_rank_0_and_failures_name_the_rank(cluster, tiny_model_dir):
    from rollwise.train.distributed import Rendezvous, free_port
    from rollwise.train.launch import build_trainer
    from rollwise.train.trainer import Trainer

    cfg = tiny_config(tiny_model_dir, **{"train.backend": "fsdp2", "train.world_size": 2, "model.threads": 1,
                                         "train.micro_batch_tokens": 48})
    model, tok = load_model(str(tiny_model_dir))
    local = Trainer(copy.deepcopy(model), cfg.train, cfg.algo, tok.pad_token_id,
                    temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens)
    rdv = Rendezvous(cluster.driver_address(), free_port(), 2)
    ranks = start_trainer_ranks(cluster, 2, rdv.addr, rdv.port, cfg.model_dump_json(), str(tiny_model_dir))
    trainer = build_trainer(cfg, model, tok.pad_token_id, model_path=str(tiny_model_dir), rendezvous=rdv)
    try:
        trainer.workers.processes = ranks.processes()
        ranks.check()  # running: nothing to report
        samples = make_samples(len(tok))
        sharded, single = trainer.step(samples, version=0), local.step(samples, version=0)
        assert sharded["train/loss"] == pytest.approx(single["train/loss"], abs=1e-5)
    finally:
        trainer.close()
    assert ranks.join(timeout_s=60) == [None]
    ranks.close()  # frees the rank's bundle
    # a rank that cannot load its model: rank 0 names it with its error; so does join()
    rdv = Rendezvous(cluster.driver_address(), free_port(), 2)
    ranks = start_trainer_ranks(cluster, 2, rdv.addr, rdv.port, cfg.model_dump_json(), "/nonexistent/model")
    with pytest.raises(RuntimeError, match=r"^trainer rank 1 failed: .*nonexistent"):
        build_trainer(cfg, model, tok.pad_token_id, model_path="/nonexistent/model", rendezvous=rdv)
    with pytest.raises(WorkerError, match=r"^trainer rank 1 failed: .*nonexistent"):  # its logged traceback
        ranks.join(timeout_s=60)
    ranks.close()
