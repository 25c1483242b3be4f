"""Secrets (`rollout.service_api_key`, `serve.api_key`) are never written or printed: not in RUN_DIR/config.toml,
not in the trackers' hyperparameters (TensorBoard, W&B offline, MLflow), not in `rollwise train --dry-run`,
not in a config error; a resumed run takes the key from the environment (or the command line) again."""

from __future__ import annotations

import tomllib
import uuid
from pathlib import Path

import pytest
from test_trackers import (MLFLOW_ENV, isolate_env, mlflow_client, wandb_history, wandb_offline,  # noqa: F401
                           wandb_run_files)
from typer.testing import CliRunner

from rollwise.validate import load
from rollwise.cli import app
from rollwise.config import ConfigError
from rollwise.config_load import load_config
from rollwise.config_toml import to_toml

SERVICE_KEY = "sekrit-service-" + uuid.uuid4().hex
SERVE_KEY = "sekrit-serve-" + uuid.uuid4().hex
SECRETS = [f"rollout.service_api_key={SERVICE_KEY}", f"serve.api_key={SERVE_KEY}"]


def files_holding(root: Path, *needles: str) -> list[str]:
    """Every file under `root` whose bytes contain one of `needles`."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and any(n.encode() in path.read_bytes() for n in needles):
            found.append(str(path.relative_to(root)))
    return found


def test_dry_run_prints_stars_and_no_secret(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "--dry-run", *SECRETS])
    assert result.exit_code == 0, result.output
    assert SERVICE_KEY not in result.output and SERVE_KEY not in result.output
    assert ("# service_api_key = *** (a secret, never written: give it as $ROLLWISE_API_KEY or "
            "rollout.service_api_key=...)") in result.stdout
    assert "# api_key = *** (a secret, never written: give it as $ROLLWISE_SERVE_API_KEY" in result.stdout
    data = tomllib.loads(result.stdout)  # still a recipe: the secrets are comments
    assert "service_api_key" not in data["rollout"] and "api_key" not in data["serve"]


def test_to_toml_drops_the_secret_and_reading_it_back_leaves_it_unset(tmp_path):
    cfg = load_config(None, SECRETS)
    assert cfg.rollout.service_api_key.get_secret_value() == SERVICE_KEY
    text = to_toml(cfg)
    assert SERVICE_KEY not in text and SERVE_KEY not in text
    (tmp_path / "config.toml").write_text(text)
    again = load_config(tmp_path / "config.toml")
    assert again.rollout.service_api_key is None and again.serve.api_key is None
    assert SERVICE_KEY not in repr(cfg) and SERVICE_KEY not in str(cfg.rollout)


def test_a_numeric_looking_key_stays_text_and_a_bad_one_is_not_echoed(tmp_path):
    assert load_config(None, ["serve.api_key=12345"]).serve.api_key.get_secret_value() == "12345"
    (tmp_path / "r.toml").write_text('[serve]\napi_key = ["sekrit-in-a-list"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "r.toml")
    assert "serve.api_key: Input should be a valid string; got ***" in str(info.value)
    assert "sekrit-in-a-list" not in str(info.value)


def test_tracker_hyperparameters_hold_stars_not_the_secret(tmp_path, monkeypatch, wandb_offline):
    from rollwise.metrics import build_sinks
    from rollwise.metrics.sinks import MLFLOW_ID_FILE

    isolate_env(monkeypatch, *MLFLOW_ENV)
    cfg = load_config(None, SECRETS)
    with build_sinks(["tensorboard", "wandb", "mlflow"], tmp_path, "secret-run", cfg.model_dump(mode="json")) as s:
        s.write({"step": 1, "reward/mean": 0.5})
    assert files_holding(tmp_path, SERVICE_KEY, SERVE_KEY) == []
    run = mlflow_client((tmp_path / "mlruns").as_uri()).get_run((tmp_path / MLFLOW_ID_FILE).read_text().strip())
    assert run.data.params["rollout.service_api_key"] == "***" and run.data.params["serve.api_key"] == "***"
    assert run.data.params["rollout.temperature"] == "1.0"  # the rest is logged as before
    [run_file] = wandb_run_files(tmp_path)
    assert wandb_history(run_file)[2]["rollout.service_api_key"] == "***"
    assert files_holding(tmp_path / "tensorboard", "***")  # the hparams summary holds the mask


@pytest.mark.slow
def test_a_service_run_writes_no_key_and_resumes_with_the_key_from_the_environment(
        tmp_path, tiny_model_dir, monkeypatch, wandb_offline):
    """`rollwise train` against a real `rollwise serve` (uvicorn thread) with every tracker: no file of the run
    holds the key; `--resume` without $ROLLWISE_API_KEY stops with one line naming it, with it the run goes on."""
    from conftest import read_rows, tiny_overrides

    from rollwise.serve.app import RunningServer, create_app
    from rollwise.serve.cli import build_service, load_engine

    isolate_env(monkeypatch, *MLFLOW_ENV, "ROLLWISE_API_KEY")
    monkeypatch.chdir(tmp_path)
    cfg = load(None, tiny_overrides(tiny_model_dir))
    engine, tok = load_engine(cfg, tmp_path / "serve")
    service = build_service(cfg, engine, tok, str(tiny_model_dir), SERVICE_KEY)
    server = RunningServer(create_app(service))
    run_dir = tmp_path / "run"
    try:
        overrides = tiny_overrides(tiny_model_dir, **{
            "rollout.source": "service", "rollout.service_url": server.url, "eval.n": 0, "train.steps": 1,
            "run.save_every_steps": 1, "run.trackers": ["tensorboard", "wandb", "mlflow"]})
        first = CliRunner().invoke(app, ["train", *overrides, f"rollout.service_api_key={SERVICE_KEY}",
                                         "--run-dir", str(run_dir)])
        assert first.exit_code == 0, first.output
        assert files_holding(run_dir, SERVICE_KEY) == []
        assert "service_api_key = ***" in (run_dir / "config.toml").read_text()
        missing = CliRunner().invoke(app, ["train", "--resume", str(run_dir), "train.steps=2"])
        assert missing.exit_code == 2, missing.output
        [line] = missing.stderr.strip().splitlines()
        assert "set $ROLLWISE_API_KEY" in line and "rollout.service_api_key=..." in line
        monkeypatch.setenv("ROLLWISE_API_KEY", SERVICE_KEY)
        resumed = CliRunner().invoke(app, ["train", "--resume", str(run_dir), "train.steps=2"])
        assert resumed.exit_code == 0, resumed.output
        assert [r["step"] for r in read_rows(run_dir) if r["kind"] == "train"] == [1, 2]
        assert service.worker.version == 2 and files_holding(run_dir, SERVICE_KEY) == []
    finally:
        server.stop()
        service.worker.close()


@pytest.mark.slow
def test_serve_takes_its_key_from_the_environment_and_never_prints_it(tiny_model_dir):
    import re
    import signal
    import subprocess
    import time

    import httpx

    from conftest import ROLLWISE, subprocess_env

    env = dict(subprocess_env(), ROLLWISE_SERVE_API_KEY=SERVE_KEY)
    proc = subprocess.Popen([ROLLWISE, "serve", "--model", str(tiny_model_dir), "--port", "0", "model.threads=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, url = [], None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            url = url or (m.group(1) if (m := re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)) else None)
            if "Ctrl-C stops" in line:
                break
        output = "".join(lines)
        assert url and "token: the one configured" in output and SERVE_KEY not in output, output
        body = {"prompt": [5, 6], "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {SERVE_KEY}"},
                       timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and SERVE_KEY not in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
