"""`reward.fn = "judge"` against real local servers over HTTP: `rollwise serve`'s app with a scripted judge
policy that always answers `Score: 7` (parsing, concurrency, a training run), the same app over the tiny random
model (its answers are cut off at [reward.judge] max_tokens: counted failures that stop a run), and a small server that
fails on purpose (retries, timeouts, HTTP errors)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import read_rows, tiny_overrides  # noqa: E402
from helpers_tokenizer import tiny_tokenizer  # noqa: E402
from rollwise.cli import app  # noqa: E402
from rollwise.config import RewardConfig  # noqa: E402
from rollwise.generate.base import EngineCaps  # noqa: E402
from rollwise.rewards import build_reward_fn, score_samples  # noqa: E402
from rollwise.serve.app import RunningServer, create_app  # noqa: E402
from rollwise.serve.cli import build_service  # noqa: E402
from rollwise.types import GenerationResult, Prompt, Sample, Status  # noqa: E402
from rollwise.validate import load  # noqa: E402

KEY = "judge-key-123"


class ScriptedJudge:
    """A judge policy behind the serve app: every request gets `text` (default `Score: 7`). It records the
    prompts it was asked (decoded) and the size of each generate call; `delay_s` makes each call slow."""

    caps = EngineCaps()
    dtype = None
    device = torch.device("cpu")

    def __init__(self, tokenizer, text: str = "Score: 7", delay_s: float = 0.0):
        self.tokenizer, self.text, self.delay_s = tokenizer, text, delay_s
        self.version = 0
        self.stats = None
        self.batches: list[int] = []
        self.prompts: list[str] = []

    def generate(self, requests, on_finish=None):
        time.sleep(self.delay_s)
        self.batches.append(len(requests))
        ids = self.tokenizer(self.text)["input_ids"] + [self.tokenizer.eos_token_id]
        out = []
        for r in requests:
            self.prompts.append(self.tokenizer.decode(r.prompt_ids))
            out.append(GenerationResult(r.request_id, list(ids), [0.0] * len(ids), Status.COMPLETED,
                                        [(0, len(ids), self.version)], text=self.text))
        return out

    def update_weights(self, state_dict, version):
        self.version = version

    def abort(self, request_ids):
        pass

    def close(self):
        pass


def _serve(engine, tokenizer, name: str):
    service = build_service(load(None, ["rollout.max_new_tokens=8"]), engine, tokenizer, name, KEY)
    return service, RunningServer(create_app(service))


@pytest.fixture(params=[0.2])
def scripted(request):
    """A `Score: 7` judge server taking `request.param` seconds per generate call."""
    engine = ScriptedJudge(tiny_tokenizer(), delay_s=request.param)
    service, server = _serve(engine, engine.tokenizer, "scripted-judge")
    yield engine, server
    server.stop()
    service.worker.close()


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    from helpers_model import tiny_llama

    from rollwise.generate.torch_engine import TorchEngine

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    service, server = _serve(TorchEngine(model, tok, max_batch_size=16), tok, "tiny-judge")
    yield server
    server.stop()
    service.worker.close()


def _samples(n: int) -> list[Sample]:
    out = []
    for i in range(n):
        prompt = Prompt(f"p{i}", [{"role": "user", "content": f"What is {i} + 1?"}], answer=str(i + 1))
        s = Sample(prompt, [1], [2, 3], [0.0, 0.0], [1, 1], Status.COMPLETED, i)
        s.response_text = f"I think it is {i + 1}."
        out.append(s)
    return out


def _judge(url: str, **settings):
    return build_reward_fn(RewardConfig(fn="judge", judge={"url": url + "/v1", "api_key": KEY, **settings}), "arith")


def test_a_judge_that_says_score_7_scores_a_batch_concurrently(scripted):
    """Eight samples, four requests in flight, a judge that takes 0.2 s per generate call: every sample gets
    0.7 (7 of 10) and is correct at the default threshold 0.5; the server batched requests that were in
    flight together; each judge prompt holds the question, the reference and the response; the model name
    came from /v1/models."""
    engine, server = scripted
    judge = _judge(server.url, concurrency=4)
    samples = _samples(8)
    try:
        metrics = score_samples(samples, judge, 30.0)
    finally:
        judge.close()
    assert [s.reward for s in samples] == [0.7] * 8 and all(s.correct for s in samples)
    assert samples[0].reward_parts == {"judge": 0.7, "correct": 1.0} and samples[0].info["judge_answer"] == "Score: 7"
    assert metrics["reward/errors"] == 0.0 and metrics["reward/accuracy"] == 1.0
    assert sum(engine.batches) == 8 and max(engine.batches) >= 2, engine.batches
    assert any("<question>\nWhat is 3 + 1?\n</question>" in p and "<reference>\n4\n</reference>" in p
               and "<response>\nI think it is 4.\n</response>" in p for p in engine.prompts)
    assert judge.model == "scripted-judge"


def test_the_threshold_decides_correctness_and_the_score_scale_normalises(scripted):
    _, server = scripted
    strict = _judge(server.url, threshold=0.75)
    scale = _judge(server.url, score_max=7.0, model="anything")
    try:
        samples = _samples(2)
        score_samples(samples, strict, 30.0)
        assert [s.reward for s in samples] == [0.7, 0.7] and [s.correct for s in samples] == [False, False]
        score_samples(samples, scale, 30.0)
        assert [s.reward for s in samples] == [1.0, 1.0] and all(s.correct for s in samples)
    finally:
        strict.close()
        scale.close()


def test_an_unparsable_judgement_from_the_tiny_model_is_a_counted_failure(tiny_judge):
    """The tiny random model as the judge: its answers run to [reward.judge] max_tokens (finish_reason 'length' from
    `rollwise serve`), so every sample is FAILED with the reason (never a reward of 0) and counted in
    reward/errors."""
    judge = _judge(tiny_judge.url, max_tokens=8)
    samples = _samples(4)
    try:
        metrics = score_samples(samples, judge, 30.0)
    finally:
        judge.close()
    assert metrics["reward/errors"] == 4.0 and "reward/mean" not in metrics
    for s in samples:
        assert s.status == Status.FAILED and s.reward is None
        assert "the judge's answer was cut off at reward.judge.max_tokens=8" in s.reward_error


@pytest.mark.slow
@pytest.mark.parametrize("scripted", [0.05], indirect=True)
def test_a_run_trains_with_the_scripted_judge_and_never_writes_its_key(tmp_path, tiny_model_dir, scripted,
                                                                       monkeypatch):
    """`rollwise train` with reward.fn = "judge" (key from $ROLLWISE_JUDGE_API_KEY): every training and eval
    sample is judged 0.7, none fails, a step's samples reach the judge together (batched generate calls), and
    no file of the run holds the key."""
    engine, server = scripted
    monkeypatch.setenv("ROLLWISE_JUDGE_API_KEY", KEY)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, **{"reward.fn": "judge", "reward.judge.url": server.url + "/v1",
                                                  "eval.n": 4, "train.steps": 2})
    result = CliRunner().invoke(app, ["train", *overrides, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    rows = read_rows(run_dir)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 2
    for row in train_rows:
        assert row["reward/mean"] == pytest.approx(0.7) and row["reward/errors"] == 0.0
    assert all(r["eval/sampled_accuracy"] == 1.0 for r in rows if r["kind"] == "eval")
    # 2 steps x 16 samples, 2 evals x (4 sampled + 4 greedy); only a training step has over 4 samples to judge
    assert sum(engine.batches) == 2 * 16 + 2 * 2 * 4 and max(engine.batches) > 4, engine.batches
    assert not [p for p in run_dir.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]


@pytest.mark.slow
def test_a_run_whose_judge_never_parses_stops_with_the_reason(tmp_path, tiny_model_dir, tiny_judge):
    """The tiny model as the judge of a run: every judgement fails, and after reward.max_failed_steps steps
    the run stops with one line that quotes why."""
    overrides = tiny_overrides(tiny_model_dir, **{"reward.fn": "judge", "reward.judge.url": tiny_judge.url + "/v1",
                                                  "reward.judge.max_tokens": 8, "eval.n": 0, "train.steps": 5})
    result = CliRunner().invoke(app, ["train", *overrides, f"reward.judge.api_key={KEY}", "--run-dir",
                                      str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "every reward failed for 2 steps in a row" in line and "cut off at reward.judge.max_tokens=8" in line
    assert [r["reward/errors"] for r in read_rows(tmp_path / "run") if r["kind"] == "train"] == [16.0, 16.0]


# -- a server that fails on purpose ------------------------------------------------------------------------
class Flaky:
    """A minimal OpenAI-compatible chat server: `script` is the list of what each call does in turn (the last
    repeats): an int is an HTTP status to fail with, a float a delay before answering, a str the answer."""

    def __init__(self, script):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        self.script, self.calls, self._lock = list(script), 0, threading.Lock()
        api = FastAPI()

        @api.get("/v1/models")
        def models():
            return {"data": [{"id": "flaky"}]}

        @api.post("/v1/chat/completions")
        def chat(body: dict):
            with self._lock:
                step = self.script[min(self.calls, len(self.script) - 1)]
                self.calls += 1
            if isinstance(step, int):
                return JSONResponse({"error": {"message": f"scripted {step}"}}, status_code=step)
            if isinstance(step, float):
                time.sleep(step)
                step = "Score: 5"
            return {"choices": [{"message": {"role": "assistant", "content": step}}]}

        self.server = RunningServer(api)
        self.url = self.server.url


@pytest.mark.parametrize("script, retries, reward, error, calls", [
    ([503, 503, "Score: 9"], 2, 0.9, None, 3),
    ([503], 1, None, "failed after 2 attempt(s) within reward.timeout_s=5 s: HTTP 503: 'scripted 503'", 2),
    ([401], 3, None, "HTTP 401: 'scripted 401' (reward.judge.api_key or $ROLLWISE_JUDGE_API_KEY)", 1),
    ([1.0], 0, None, "no answer within reward.timeout_s=0.5 s", 1),
    (["Score: 12"], 2, None, "the judge's score 12 is outside 0..10: 'Score: 12'", 1),
    (["<score>3</score>"], 0, None, "holds no verdict line 'Score: N'", 1),  # one verdict form: 'Score: N'
    (["The response is right.\nScore: 3"], 0, 0.3, None, 1),
    ([408], 2, None, "HTTP 408: 'scripted 408'", 1),  # only 429 and 5xx are retried
    ([409], 2, None, "HTTP 409: 'scripted 409'", 1),
    ([429, 500, 599, "Score: 4"], 3, 0.4, None, 4),
])
def test_retries_timeouts_and_bad_answers(script, retries, reward, error, calls, monkeypatch):
    monkeypatch.setattr("rollwise.rewards.judge.BACKOFF_S", 0.01)
    flaky = Flaky(script)
    timeout = 0.5 if isinstance(script[0], float) else 5.0
    judge = build_reward_fn(RewardConfig(fn="judge", judge={"url": flaky.url + "/v1", "retries": retries}), "arith")
    try:
        [sample] = _samples(1)
        score_samples([sample], judge, timeout)
    finally:
        judge.close()
        flaky.server.stop()
    assert sample.reward == reward and flaky.calls == calls
    if error is None:
        assert sample.status == Status.COMPLETED
    else:
        assert sample.status == Status.FAILED and error in sample.reward_error, sample.reward_error


@pytest.mark.parametrize("extra, message", [
    ({}, "reward.fn = 'judge' needs reward.judge.url"),
    ({"reward.judge.url": "127.0.0.1:8000"}, "must start with http:// or https://"),
    ({"reward.judge.url": "http://x/v1", "reward.judge.template": "{question} {rubric} {response}"},
     "reward.judge.template uses {rubric}; valid fields: {question}, {reference}, {answer}, {response}"),
    ({"reward.judge.url": "http://x/v1", "reward.judge.template": "Grade {question}"},
     "reward.judge.template must contain {response}"),
    ({"reward.judge.url": "http://x/v1", "reward.isolate": True}, "set reward.isolate = false"),
])
def test_bad_judge_settings_fail_at_dry_run(tiny_model_dir, extra, message):
    result = CliRunner().invoke(app, ["train", *tiny_overrides(tiny_model_dir, **{"reward.fn": "judge", **extra}),
                                      "--dry-run"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_the_judge_key_is_never_printed(tiny_model_dir):
    result = CliRunner().invoke(app, ["train", *tiny_overrides(tiny_model_dir, **{
        "reward.fn": "judge", "reward.judge.url": "http://127.0.0.1:9/v1"}), "reward.judge.api_key=sk-NOT-SHOWN",
        "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "sk-NOT-SHOWN" not in result.output and "give it as $ROLLWISE_JUDGE_API_KEY" in result.output


# --- the judge as the reward of a [[data.mix]] source ----------------------------------------------------------

MIX_WITH_JUDGE = """
[data]
[[data.mix]]
task = "arith"
name = "exact"
eval_size = 20

[[data.mix]]
task = "arith"
name = "judged"
reward = "judge"
eval_size = 20
"""


def test_a_mixture_source_scored_by_the_judge_trains_with_its_samples_judged_together(tmp_path, tiny_model_dir,
                                                                                     scripted, monkeypatch):
    """`rollwise train` of a two-source mixture whose second source's reward is the judge: the judge is built
    from the [reward] settings (before, the mixture called the bare `judge` and every sample failed), its
    samples reach the server together (concurrent requests, batched generate calls), they all score 0.7, and
    the first source keeps its own arith reward."""
    engine, server = scripted
    monkeypatch.setenv("ROLLWISE_JUDGE_API_KEY", KEY)
    recipe = tmp_path / "mix.toml"
    recipe.write_text(MIX_WITH_JUDGE)
    overrides = tiny_overrides(tiny_model_dir, **{"reward.judge.url": server.url + "/v1", "eval.n": 0,
                                                  "train.steps": 1, "data.eval_size": None})
    result = CliRunner().invoke(app, ["train", str(recipe), *overrides, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    row = next(r for r in read_rows(tmp_path / "run") if r["kind"] == "train")
    assert row["reward/errors"] == 0.0 and row["reward/judged/mean"] == pytest.approx(0.7)
    assert row["reward/judged/samples"] == 8.0 and row["reward/exact/samples"] == 8.0
    assert sum(engine.batches) == 8 and max(engine.batches) >= 2, engine.batches


@pytest.mark.parametrize("extra, message", [
    ({}, '[[data.mix]] number 2 ("judged"): reward \'judge\': reward.fn = \'judge\' needs reward.judge.url'),
    ({"reward.judge.url": "http://x/v1", "reward.isolate": True}, "set reward.isolate = false"),
])
def test_a_mixture_judge_without_its_settings_fails_at_dry_run(tmp_path, tiny_model_dir, extra, message):
    recipe = tmp_path / "mix.toml"
    recipe.write_text(MIX_WITH_JUDGE)
    result = CliRunner().invoke(app, ["train", str(recipe), "--dry-run",
                                      *tiny_overrides(tiny_model_dir, **{"data.eval_size": None, **extra})])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
