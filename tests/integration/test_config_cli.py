"""Config errors from the command line: `python -m trainer` with a misspelt key exits 2, naming the key
and the closest valid one, before any work."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO, SMOKE


def test_cli_reports_config_error_before_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", str(SMOKE), "train.setps=3", f"run.dir={tmp_path}/run"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "config error: unknown config key 'train.setps'" in proc.stderr
    assert "did you mean 'train.steps'" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started
