"""W&B logging (trainer.observability.wandb_log), offline in this process: the missing package is a config error at
start; a resumed run continues the W&B run and leaves out the steps already logged; a fresh run gets
a new W&B run; a refused login stops the run, W&B out of reach does not."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers import SMOKE, wandb_offline_env, wandb_offline_runs
from trainer.config.schema import ConfigError


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for key, value in wandb_offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return tmp_path


def test_log_wandb_without_the_package_is_a_config_error(monkeypatch, capsys):
    from trainer.__main__ import main
    from trainer.observability.wandb_log import check_installed

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert main([str(SMOKE), "log.wandb=true"]) == 2
    assert capsys.readouterr().err == (
        "config error: log.wandb=true needs the wandb package: pip install 'rekindle[wandb]'\n")
    check_installed(False)  # not asked for: not needed


def test_a_resumed_run_continues_the_wandb_run_without_the_steps_it_has(offline):
    from trainer.observability.wandb_log import WandbLog

    first = WandbLog(str(offline), "my run/1", "rekindle", "offline", {"train": {"steps": 8}}, start_step=0)
    for step in range(1, 6):
        first.log({"loss/train": 10.0 - step}, step)
    first.close(clean=False)  # crashed after step 5; its checkpoint is step 4
    resumed = WandbLog(str(offline), "my run/1", "rekindle", "offline", {}, start_step=4)
    assert resumed.run.id == first.run.id and resumed.last_step == 5
    for step in range(5, 9):
        resumed.log({"loss/train": 20.0 - step}, step)
    resumed.close()
    fresh = WandbLog(str(offline), "my run/1", "rekindle", "offline", {}, start_step=0)  # started over
    fresh.close()

    runs = wandb_offline_runs(offline)
    assert [run_id for run_id, _ in runs] == [first.run.id, first.run.id, fresh.run.id]
    assert first.run.id.startswith("my-run-1-") and fresh.run.id != first.run.id
    assert runs[0][1] == [(s, {"loss/train": 10.0 - s}) for s in range(1, 6)]
    assert runs[1][1] == [(s, {"loss/train": 20.0 - s}) for s in range(6, 9)]  # step 5 once: the first's
    assert runs[2][1] == []


def test_a_refused_login_stops_the_run_and_no_network_does_not(offline, monkeypatch, capsys):
    import wandb

    from trainer.config import load
    from trainer.observability import wandb_log

    cfg = load(SMOKE, [f"run.dir={offline}", "log.wandb=true"])

    def refuse(error):
        def init(**kwargs):
            raise error
        return init

    monkeypatch.setattr(wandb, "init", refuse(wandb.errors.UsageError("No API key configured.")))
    with pytest.raises(ConfigError, match="log.wandb: No API key configured"):
        wandb_log.start(cfg, 0)
    monkeypatch.setattr(wandb, "init", refuse(wandb.errors.CommError("connection refused")))
    assert wandb_log.start(cfg, 0) is None
    assert "W&B unavailable, training goes on without it: CommError: connection refused" in capsys.readouterr().out
    cfg.log.wandb = False
    assert wandb_log.start(cfg, 0) is None
