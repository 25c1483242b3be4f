"""Where code may run unconfined: only where the user opted in; and the slot lock directory must be private."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

import rollwise.sandbox as sandbox
from rollwise.cli import app
from rollwise.rewards.scoring import score_batch
from rollwise.rewards.code import code_tests_reward
from rollwise.sandbox import Limits, SandboxError, run
from rollwise.sandbox import bwrap as bw
from rollwise.types import Prompt, Sample, Status

SMALL = Limits(cpu_s=2, wall_s=5, memory_mb=256, max_processes=8, max_file_mb=1, max_output_bytes=4096, disk_mb=8)


@pytest.fixture
def no_bwrap(monkeypatch):
    """A machine without bubblewrap, and no opt-in from the environment."""
    monkeypatch.setattr(bw, "bwrap_path", lambda: None)
    monkeypatch.setattr(sandbox, "_warned", set())
    monkeypatch.delenv(sandbox.ENV_UNCONFINED, raising=False)
    monkeypatch.delenv(sandbox.ENV_BACKEND, raising=False)


def test_auto_without_bubblewrap_refuses_to_run_code_unconfined(no_bwrap):
    with pytest.raises(SandboxError, match=r"bubblewrap \(bwrap\) is not installed, so code would run unconfined.*"
                                           r"sandbox.allow_unconfined = true"):
        run("print(1)", limits=SMALL)


def test_auto_falls_back_with_a_warning_once_the_user_opted_in(no_bwrap, monkeypatch):
    monkeypatch.setenv(sandbox.ENV_UNCONFINED, "allow")
    with pytest.warns(RuntimeWarning, match="NOT contained: the network"):
        result = run("print(1)", limits=SMALL)
    assert (result.stdout, result.backend) == ("1\n", "rlimits")


def test_asking_for_rlimits_by_name_is_an_opt_in(no_bwrap):
    with pytest.warns(RuntimeWarning, match="backend 'rlimits' was asked for"):
        assert run("print(2)", limits=SMALL, backend="rlimits").stdout == "2\n"


def test_bubblewrap_that_cannot_start_is_refused_too(monkeypatch):
    monkeypatch.setattr(bw, "bwrap_path", lambda: "/bin/false")  # installed, exits 1 at once
    monkeypatch.setattr(bw, "_PROBED", {})
    monkeypatch.delenv(sandbox.ENV_UNCONFINED, raising=False)
    monkeypatch.delenv(sandbox.ENV_BACKEND, raising=False)
    with pytest.raises(SandboxError, match=r"bubblewrap is installed but cannot start .* so code would run unconfined"):
        run("print(1)", limits=SMALL)


def test_a_code_reward_without_the_sandbox_fails_the_sample_with_the_reason(no_bwrap):
    """Through scoring: the sample is FAILED with the one-line reason, never scored 0 or run unconfined."""
    prompt = Prompt("p", [{"role": "user", "content": "write f"}], info={"tests": ["assert f(2) == 4"]})
    sample = Sample(prompt, [1], [2], [-0.1], [1], Status.COMPLETED, 0,
                    response_text="```python\ndef f(x):\n    return x * 2\n```")
    assert score_batch([sample], code_tests_reward) == []
    assert sample.status == Status.FAILED and "so code would run unconfined" in sample.reward_error


def test_dry_run_of_a_code_task_fails_in_one_line_without_the_sandbox(no_bwrap, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "--dry-run", "data.task=pyexec"])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "data.task = 'pyexec' runs the policy's code, but bubblewrap (bwrap) is not installed" in line
    assert "sandbox.allow_unconfined = true" in line and "Traceback" not in result.output
    ok = CliRunner().invoke(app, ["train", "--dry-run", "data.task=pyexec", "sandbox.allow_unconfined=true"])
    assert ok.exit_code == 0 and "allow_unconfined = true" in ok.output
    reward = CliRunner().invoke(app, ["train", "--dry-run", "reward.fn=code_tests"])
    assert reward.exit_code == 2 and "reward.fn = 'code_tests' runs the policy's code" in reward.output


def test_the_config_opt_in_reaches_reward_worker_processes(no_bwrap):
    """`sandbox.allow_unconfined = true` is applied to the environment (reward workers inherit it) and withdrawn
    by a later run of the same process that does not opt in."""
    sandbox.allow_unconfined(True)
    try:
        assert os.environ[sandbox.ENV_UNCONFINED] == "allow"
        with pytest.warns(RuntimeWarning):
            assert run("print(3)", limits=SMALL).backend == "rlimits"
    finally:
        sandbox.allow_unconfined(False)
    assert sandbox.ENV_UNCONFINED not in os.environ


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another uid needs root")
@pytest.mark.filterwarnings("ignore:rollwise sandbox")
def test_a_lock_directory_another_user_made_first_is_refused(monkeypatch):
    import shutil
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix="rollwise-test-tmpdir-", dir="/tmp"))
    tmp.chmod(0o711)  # the fallback's work dir goes here too: the pool uid must pass through
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        check_planted_directories(tmp)
    finally:
        shutil.rmtree(tmp)


def check_planted_directories(tmp):
    planted = tmp / f"rollwise-sandbox-slots-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 12345, 12345)
    with pytest.raises(SandboxError, match=rf"sandbox lock directory {planted} is a directory owned by uid 12345"):
        run("print(1)", limits=SMALL, backend="rlimits")
    os.chown(planted, 0, 0)
    os.chmod(planted, 0o777)  # ours, but others may enter and plant lock files
    with pytest.raises(SandboxError, match="with mode 777; it must be this user's"):
        run("print(1)", limits=SMALL, backend="rlimits")
    os.chmod(planted, 0o700)
    assert run("print(1)", limits=SMALL, backend="rlimits").stdout == "1\n"
