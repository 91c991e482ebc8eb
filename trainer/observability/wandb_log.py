"""Weights & Biases logging (`log.wandb=true`): rank 0 sends the scalars TensorBoard gets, under the same
names, to one W&B run per training run; its files are in run.dir/wandb/.

A training run that starts at step 0 opens a new W&B run and keeps its id in
run.dir/wandb/rekindle-run.json (WANDB_RUN_ID, where set, names it instead). A run resumed from a
checkpoint (after a crash, a preemption, a restart by the launcher) continues that W&B run
(`resume="allow"`) and leaves out the steps W&B already has: the earlier attempt logged past the
checkpoint, the resumed one redoes those steps, and a W&B history only goes forward. Online, W&B says
where the run's history ends; offline, each attempt writes its own offline-run directory with the
same run id (`wandb sync` uploads them) and the last step sent, kept in the same file, counts. So
each step is logged once, and the redone steps keep the earlier attempt's values (TensorBoard, which
purges, shows the resumed ones). W&B's rewind (`wandb.init(resume_from=...)`) would replace them, but
it is a preview feature of W&B's server (offline, wandb 0.31 accepts it and only records the rewind
point for `wandb sync`), so it is not used. What wandb had not yet written when an attempt is killed
outright (SIGKILL) is lost: offline, that can leave a gap after the checkpoint.

The wandb package is an optional extra (`pip install 'rekindle[wandb]'`), checked at start-up
(`check_installed`). A missing or refused API key is a ConfigError (exit 2); W&B out of reach is a
warning. W&B takes its credentials from its own login or WANDB_API_KEY; nothing here reads or prints
them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from common import storage
from trainer.config.schema import ConfigError
from trainer.observability import logs

if TYPE_CHECKING:
    from trainer.config import Config

log = logs.get_logger("wandb")

STATE = "rekindle-run.json"  # in run.dir/wandb/: {"id": W&B run id, "step": last step logged}


def check_installed(enabled: bool) -> None:
    """ConfigError when log.wandb=true and the wandb package is not installed."""
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb=true needs the wandb package: pip install 'rekindle[wandb]'")


def start(cfg: Config, start_step: int) -> WandbLog | None:
    """Rank 0's W&B run with log.wandb=true, else None. W&B out of reach (no network, server errors)
    is said and training goes on without it: metrics.jsonl has every step."""
    if not cfg.log.wandb:
        return None
    try:
        return WandbLog(cfg.run.dir, cfg.run.name, cfg.log.wandb_project, cfg.log.wandb_mode, cfg.to_dict(),
                        start_step)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a logging service must not stop the training
        log.warning("W&B unavailable, training goes on without it: %s: %s", type(e).__name__, e)
        return None


class WandbLog:
    """A W&B run that takes each step once (see the module docstring)."""

    def __init__(self, run_dir: str, name: str, project: str, mode: str, config: dict, start_step: int) -> None:
        import wandb

        self.state_path = Path(run_dir) / "wandb" / STATE
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        state = json.loads(self.state_path.read_text()) if start_step and self.state_path.exists() else {}
        # WANDB_RUN_ID, where set, names the W&B run; otherwise a fresh run gets a new id
        run_id = os.environ.get("WANDB_RUN_ID") or state.get("id") or (
            re.sub(r"[^A-Za-z0-9_-]", "-", name)[:48] + "-" + uuid.uuid4().hex[:8])
        try:
            self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=run_dir,
                                  mode=None if mode == "auto" else mode, config=config)
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            raise ConfigError(f"log.wandb: {e}") from e  # no API key, or a bad one: a restart cannot fix it
        # Online, W&B says where the run's history ends; offline, the state file says what was sent to it
        logged = state.get("step", 0) if state.get("id") == run_id else 0
        self.last_step = logged if self.run.offline else max(self.run.starting_step - 1, 0)
        self._save()
        log.info("W&B run %s (%s)%s", run_id, self.run.settings.mode,
                 f": steps up to {self.last_step} were logged before" if self.last_step else "")

    def log(self, scalars: dict[str, float], step: int) -> None:
        if step <= self.last_step or not scalars:
            return
        self.run.log(scalars, step=step, commit=True)  # the step is complete: written now, not at the next one
        self.last_step = step
        self._save()

    def _save(self) -> None:
        storage.atomic_write(self.state_path, json.dumps({"id": self.run.id, "step": self.last_step}).encode())

    def close(self, clean: bool = True) -> None:
        self.run.finish(exit_code=0 if clean else 1)
