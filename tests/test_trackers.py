"""TensorBoard, W&B (offline) and MLflow (file store) sinks: the real libraries write real files, read back here."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path

import pytest

from rollwise.validate import load
from rollwise.config import Config, ConfigError
from rollwise.config_load import load_config
from rollwise.metrics import build_sinks, read_metrics
from rollwise.metrics.sinks import MLFLOW_ID_FILE, WANDB_ID_FILE, flatten_config, tracker_scalars

CONFIG = {"train": {"lr": 1e-6, "steps": 3}, "reward": {"fn": "pkg.mod:fn"}, "rollout": {"stop": ["\n\n"]},
          "run": {"name": None}}
ROWS = [
    {"kind": "eval", "step": 0, "eval/greedy_accuracy": 0.25, "perf/time/eval_s": 2.0},
    {"kind": "train", "step": 1, "reward/mean": 0.5, "train/loss": math.nan, "note": "text is not a metric"},
    {"kind": "train", "step": 2, "reward/mean": 0.75, "train/loss": 0.125},
    {"kind": "eval", "step": 2, "eval/greedy_accuracy": 0.5, "perf/time/eval_s": 3.0},
]
# the tracker's view of ROWS: `name -> [(step, value)]`, eval rows under eval/
EXPECTED = {
    "reward/mean": [(1, 0.5), (2, 0.75)],
    "eval/greedy_accuracy": [(0, 0.25), (2, 0.5)],
    "eval/perf/time/eval_s": [(0, 2.0), (2, 3.0)],
}


def isolate_env(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Unset `names` for this test and restore them afterwards, also when the code under test sets them."""
    for name in names:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)


def write_rows(run_dir: Path, tracker: str, rows: list[dict] = ROWS, **kwargs) -> None:
    with build_sinks([tracker], run_dir, "my-run", CONFIG, **kwargs) as sinks:
        for row in rows:
            sinks.write(row)


def test_tracker_scalars_prefix_eval_rows_and_keep_nonfinite() -> None:
    assert tracker_scalars(ROWS[0]) == {"eval/greedy_accuracy": 0.25, "eval/perf/time/eval_s": 2.0}
    train = tracker_scalars({**ROWS[1], "flag": True, "x": "inf"})
    assert train.keys() == {"reward/mean", "train/loss", "x"} and math.isnan(train["train/loss"])
    assert train["x"] == math.inf  # a JSONL spelling of inf is still a number


def test_flatten_config_joins_sections_with_dots() -> None:
    assert flatten_config(CONFIG) == {"train.lr": 1e-6, "train.steps": 3, "reward.fn": "pkg.mod:fn",
                                      "rollout.stop": '["\\n\\n"]', "run.name": "null"}


def test_a_secret_in_a_hand_made_config_dict_is_logged_as_stars(tmp_path: Path, monkeypatch) -> None:
    """`Config.model_dump(mode="json")` masks the API keys already; a plain dict holding one is masked too."""
    isolate_env(monkeypatch, *MLFLOW_ENV)
    config = {"rollout": {"service_api_key": "raw-key-123", "temperature": 0.5}, "serve": {"api_key": None}}
    assert flatten_config(config) == {"rollout.service_api_key": "***", "rollout.temperature": 0.5,
                                      "serve.api_key": "null"}
    with build_sinks(["mlflow"], tmp_path, "r", config) as sinks:
        sinks.write({"step": 1, "reward/mean": 0.5})
    params = mlflow_client((tmp_path / "mlruns").as_uri()).get_run(
        (tmp_path / MLFLOW_ID_FILE).read_text().strip()).data.params
    assert params["rollout.service_api_key"] == "***" and params["rollout.temperature"] == "0.5"


# --- TensorBoard ------------------------------------------------------------------------------------------------


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_file_holds_the_scalars_and_the_config(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    write_rows(tmp_path, "tensorboard")
    scalars = tensorboard_scalars(tmp_path)
    assert {tag: scalars[tag] for tag in EXPECTED} == EXPECTED
    assert scalars["train/loss"][1] == (2, 0.125) and math.isnan(scalars["train/loss"][0][1])
    assert set(scalars) == set(EXPECTED) | {"train/loss"}
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["train.lr"].number_value == 1e-6 and start.hparams["reward.fn"].string_value == "pkg.mod:fn"


def test_tensorboard_resume_appends_and_purges_steps_after_the_checkpoint(tmp_path: Path) -> None:
    first = [{"step": s, "reward/mean": 0.1 * s} for s in range(1, 6)]
    write_rows(tmp_path, "tensorboard", first)
    again = [{"step": s, "reward/mean": 1.0 + s} for s in range(4, 7)]  # killed after step 5, checkpoint at 3
    write_rows(tmp_path, "tensorboard", again, resume_step=3)
    values = tensorboard_scalars(tmp_path)["reward/mean"]
    assert [step for step, _ in values] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in values] == pytest.approx([0.1, 0.2, 0.3, 5.0, 6.0, 7.0])
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # same log dir, one file each


# --- W&B (offline) ----------------------------------------------------------------------------------------------

WANDB_ENV = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_SILENT", "WANDB_DISABLE_GIT", "WANDB_DISABLE_CODE",
             "WANDB_CONSOLE", "WANDB_ERROR_REPORTING", "WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME")


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No API key (so the sink must go offline); W&B's own config and cache dirs under tmp_path."""
    isolate_env(monkeypatch, *WANDB_ENV)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def wandb_run_files(run_dir: Path) -> list[Path]:
    """The run's offline `.wandb` files, oldest first (W&B adds `-1` to a directory started in the same second)."""
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    return sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))


def wandb_records(path: Path):
    """The protobuf records of a `.wandb` file: a LevelDB-style log (32 KiB blocks of 7-byte-headed chunks)
    after a 7-byte `:W&B` header, each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / zero padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def wandb_history(path: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float], dict[str, object]]:
    """`(history name -> [(step, value)], last summary values, config)` of one offline run file."""
    history: dict[str, list[tuple[int, float]]] = {}
    summary: dict[str, float] = {}
    config: dict[str, object] = {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((items["_step"], value))
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.summary.update})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return history, summary, config


def test_wandb_offline_run_file_holds_history_summary_and_config(tmp_path: Path, wandb_offline: None) -> None:
    write_rows(tmp_path, "wandb")
    assert os.environ["WANDB_MODE"] == "offline"  # no key: offline, set for the whole process
    [run_file] = wandb_run_files(tmp_path)
    history, summary, config = wandb_history(run_file)
    assert {key: history[key] for key in EXPECTED} == EXPECTED
    assert history["train/loss"][1] == (2, 0.125)
    assert summary["reward/mean"] == 0.75 and summary["eval/greedy_accuracy"] == 0.5  # the last values
    assert config["train.lr"] == 1e-6 and config["reward.fn"] == "pkg.mod:fn"


def test_wandb_resume_reuses_the_run_id(tmp_path: Path, wandb_offline: None) -> None:
    write_rows(tmp_path, "wandb", ROWS[:2])
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    write_rows(tmp_path, "wandb", ROWS[2:], resume_step=1)
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run_id
    steps = [step for f in wandb_run_files(tmp_path) for step, _ in wandb_history(f)[0]["reward/mean"]]
    assert steps == [1, 2]  # `wandb sync` uploads both files into the one run id


# --- MLflow (file store) ----------------------------------------------------------------------------------------

MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_DISABLE_TELEMETRY")


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def mlflow_history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_mlflow_file_store_holds_metrics_and_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_env(monkeypatch, *MLFLOW_ENV)
    write_rows(tmp_path, "mlflow")
    run_id = (tmp_path / MLFLOW_ID_FILE).read_text().strip()
    client = mlflow_client((tmp_path / "mlruns").as_uri())
    for key, expected in EXPECTED.items():
        assert mlflow_history(client, run_id, key) == expected
    loss = mlflow_history(client, run_id, "train/loss")
    assert loss[1] == (2, 0.125) and math.isnan(loss[0][1])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "my-run"
    assert run.data.params["train.lr"] == "1e-06" and run.data.params["reward.fn"] == "pkg.mod:fn"
    assert client.get_experiment(run.info.experiment_id).name == "rollwise"


def test_mlflow_resume_appends_to_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_env(monkeypatch, *MLFLOW_ENV)
    write_rows(tmp_path, "mlflow", ROWS[:2])
    run_id = (tmp_path / MLFLOW_ID_FILE).read_text().strip()
    write_rows(tmp_path, "mlflow", ROWS[2:], resume_step=1)
    client = mlflow_client((tmp_path / "mlruns").as_uri())
    assert (tmp_path / MLFLOW_ID_FILE).read_text().strip() == run_id
    assert mlflow_history(client, run_id, "reward/mean") == [(1, 0.5), (2, 0.75)]
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1


def test_mlflow_tracking_uri_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_env(monkeypatch, *MLFLOW_ENV)
    store = tmp_path / "shared-store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    write_rows(tmp_path / "run", "mlflow")
    assert not (tmp_path / "run" / "mlruns").exists()
    client = mlflow_client(store.as_uri())
    run_id = (tmp_path / "run" / MLFLOW_ID_FILE).read_text().strip()
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "team"
    assert mlflow_history(client, run_id, "reward/mean") == [(1, 0.5), (2, 0.75)]


# --- no network without a key or a server -----------------------------------------------------------------------

NO_NETWORK_SCRIPT = """
import sys
hosts = []
def audit(event, args):  # every name lookup and every non-Unix-socket connect made from Python
    if event == "socket.getaddrinfo" or (event == "socket.connect" and not isinstance(args[1], str)):
        hosts.append(str(args[:2] if event == "socket.getaddrinfo" else args[1]))
sys.addaudithook(audit)
from rollwise.metrics import build_sinks
with build_sinks(["tensorboard", "wandb", "mlflow"], sys.argv[1], "net", {"train": {"lr": 0.1}}) as sinks:
    sinks.write({"step": 1, "reward/mean": 0.5})
print("HOSTS", hosts)
"""


def test_trackers_make_no_network_call_offline(tmp_path: Path) -> None:
    """MLflow 3 sends usage telemetry at import and W&B can phone home: neither may happen for local files.
    (Python-level sockets only; W&B's Go service talks to this process over a Unix socket.)"""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"))
    out = subprocess.run([sys.executable, "-c", NO_NETWORK_SCRIPT, str(tmp_path / "run")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HOSTS []" in out.stdout, out.stdout
    assert (tmp_path / "run" / "mlruns").is_dir() and list((tmp_path / "run" / "wandb").glob("offline-run-*"))


# --- missing libraries ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_config_names_the_pip_command_for_a_tracker_that_is_not_installed(
        tracker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    Config.model_validate({"run": {"trackers": [tracker]}})  # installed here: accepted
    monkeypatch.setitem(sys.modules, tracker, None)  # Python's own way to make a module unimportable
    load_config(None, [f'run.trackers=["jsonl", "{tracker}"]'])  # parsing is not validation
    with pytest.raises(ConfigError) as info:
        load(None, [f'run.trackers=["jsonl", "{tracker}"]'])  # the step every command runs
    assert f"run.trackers: '{tracker}' is not installed; pip install 'rollwise[{tracker}]'" in str(info.value)


def test_build_sinks_without_the_library_names_the_extra_and_closes_jsonl(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install 'rollwise\[mlflow\]'"):
        build_sinks(["mlflow"], tmp_path)
    assert (tmp_path / "metrics.jsonl").exists() and read_metrics(tmp_path) == []


# --- wired into a training run ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_run_writes_every_tracker_and_resumes_into_them(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, wandb_offline: None) -> None:
    from conftest import tiny_config

    from rollwise.loop import train

    isolate_env(monkeypatch, *MLFLOW_ENV)
    trackers = {"run.trackers": ["tensorboard", "wandb", "mlflow"], "run.save_every_steps": 1, "eval.n": 4,
                "reward.fn": "toy_plugins:digit_fraction"}  # a dense reward: values that differ per step
    run_dir = tmp_path / "run"
    train(tiny_config(tiny_model_dir, **trackers, **{"train.steps": 2}), run_dir)
    train(tiny_config(tiny_model_dir, **trackers, **{"train.steps": 3}), run_dir, resume=True)
    jsonl = [(r["step"], r["reward/mean"]) for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [step for step, _ in jsonl] == [1, 2, 3]
    assert_series(tensorboard_scalars(run_dir)["reward/mean"], jsonl)
    client = mlflow_client((run_dir / "mlruns").as_uri())
    run_id = (run_dir / MLFLOW_ID_FILE).read_text().strip()
    assert_series(mlflow_history(client, run_id, "reward/mean"), jsonl)
    assert [s for s, _ in mlflow_history(client, run_id, "eval/greedy_accuracy")] == [0, 2, 3]
    assert client.get_run(run_id).info.status == "FINISHED"  # closed by train()
    files = wandb_run_files(run_dir)
    assert len(files) == 2
    assert_series([v for f in files for v in wandb_history(f)[0]["reward/mean"]], jsonl)


def assert_series(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """Same steps; same values up to float32 rounding (TensorBoard stores float32)."""
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6)
