"""Bad input that no restart can fix, under the launcher and the exporter: a data path that does not
exist, a manifest that is not UTF-8, a truncated shard, an export of an empty directory. Each is one `error:` line and
exit code 2, and the launcher does not restart the ranks."""

from __future__ import annotations

import shutil
import subprocess
import sys

from data.corpus import ensure_builtin
from tests.helpers import REPO, child_env, finish, launch
from trainer.runtime.protocol import read_events


def test_bad_input_is_one_line_exit_2_and_never_restarted(cache_dir, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "manifest.json").write_bytes(b"\xff\xfe not a manifest \x80")
    truncated = tmp_path / "truncated"  # the built-in corpus, its shards cut short
    shutil.copytree(ensure_builtin(512, 1.0, progress=False), truncated)
    for shard in truncated.glob("shard-*.bin"):
        shard.write_bytes(shard.read_bytes()[:-64])
    cases = {
        f"data.path={tmp_path / 'nowhere'}": f"the data path {tmp_path / 'nowhere'} does not exist",
        f"data.path={corrupt}": "manifest.json",
        f"data.path={truncated}": "bytes, the manifest says",
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    export = subprocess.Popen([sys.executable, "-m", "trainer.export", str(empty), str(tmp_path / "out.safetensors")],
                              cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # All at once (separate run directories): each must stop by itself. (No fork server: nothing restarts.)
    procs = {n: launch(tmp_path / f"run{n}", [override, "train.steps=4", "fault.warm_restarts=false"], nproc=1)
             for n, override in enumerate(cases)}
    try:
        outs = {n: finish(proc, timeout=120) for n, proc in procs.items()}
        _, stderr = export.communicate(timeout=120)
    finally:
        for proc in [*procs.values(), export]:
            if proc.poll() is None:
                proc.kill()
    for n, why in enumerate(cases.values()):
        proc, out = procs[n], outs[n]
        assert proc.returncode == 2, out[-3000:]
        assert "Traceback" not in out and out.count("worker(s) started") == 1, out[-3000:]
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and why in errors[0], errors
        events = read_events(tmp_path / f"run{n}")
        assert not [e for e in events if e["event"] == "restart"] and events[-1]["exit_code"] == 2
        assert "restarting cannot fix it" in events[-1]["outcome"] or events[-1]["outcome"].startswith("rank 0")

    assert export.returncode == 2 and "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: no committed checkpoint in {empty}"]
