"""scripts/project_goodput.py: the projection's ordering and scaling, events read into medians, errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "project_goodput.py"
spec = importlib.util.spec_from_file_location("project_goodput", SCRIPT)
pg = importlib.util.module_from_spec(spec)
sys.modules["project_goodput"] = pg  # dataclasses resolve their module's annotations through sys.modules
spec.loader.exec_module(pg)


def goodputs(gpus: int, m=None, a=None) -> dict[str, float]:
    return {r.strategy: r.goodput for r in pg.project(m or pg.Measured(), a or pg.Assumptions(), gpus)}


def test_in_process_with_spares_beats_warm_restart_beats_durable_restart_at_every_scale():
    for gpus in (1024, 16384, 100000):
        g = goodputs(gpus)
        assert g["in-process-spares"] >= g["memory"] >= g["durable"], (gpus, g)
        assert g["in-process-spares"] >= g["in-process"], (gpus, g)  # a lost node costs no world restart
    assert goodputs(100000)["durable"] < 0.9 * goodputs(100000)["in-process-spares"]


def test_the_wait_for_a_spare_is_read_from_the_resume_before_an_in_process_done_naming_one(tmp_path):
    resume = {"event": "resume", "reason": "failure", "path": "in-process", "tier": "memory-peer", "leave_s": 0.0,
              "restore_s": 0.01, "first_step_s": 0.1, "lost_steps": 0, "reform_s": 0.1}
    events = [dict(resume, time=10.0, node="a", wait_s=0.2),  # a rank replaced: no spare
              {"event": "in_process_done", "time": 10.1, "node": "a", "spare": ""},
              dict(resume, time=20.0, node="a", wait_s=1.4),
              {"event": "in_process_done", "time": 20.1, "node": "a", "spare": "host:7"}]
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events))
    m = pg.measure([tmp_path])
    assert m.spare_s == pytest.approx(1.5) and m.sources["spare_s"] == "median of 1"
    slower = pg.recovery(m, pg.Assumptions(), 1024)["in-process-spares"][0]
    assert slower > pg.recovery(pg.Measured(), pg.Assumptions(), 1024)["in-process-spares"][0]


def test_goodput_falls_with_the_gpu_count_for_every_strategy():
    scales = [goodputs(n) for n in (256, 1024, 16384, 100000, 131072)]
    for strategy in pg.STRATEGIES:
        series = [g[strategy] for g in scales]
        assert all(a > b for a, b in zip(series, series[1:], strict=False)), (strategy, series)
        assert all(0 < x < 1 for x in series)


def test_failures_scale_linearly_with_gpus_at_the_llama3_rate():
    per_day = {n: pg.project(pg.Measured(), pg.Assumptions(), n)[0].failures_per_day for n in (16384, 32768)}
    assert per_day[16384] == pytest.approx(419 / 54, rel=1e-3)  # Llama 3: 419 in 54 days on 16,384 GPUs
    assert per_day[32768] == pytest.approx(2 * 419 / 54, rel=1e-3)


def test_resume_events_become_medians_and_a_missing_path_reads_as_restart(tmp_path):
    base = {"event": "resume", "time": 1.0, "reason": "failure"}
    restart = [dict(base, tier="memory-local", spawn_s=s, startup_s=1.0, load_s=0.5, first_step_s=0.2, lost_steps=0)
               for s in (10.0, 20.0, 30.0)]
    restart[0]["path"] = "restart"  # the other two have no path: restarts too
    inproc = [dict(base, path="in-process", leave_s=0.1, wait_s=w, reform_s=0.01, restore_s=0.05, first_step_s=0.2,
                   lost_steps=0) for w in (0.99, 2.99)]
    lines = [json.dumps(e) for e in [{"event": "failure", "time": 0.5}, *restart, *inproc]]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + '\n{"event": "resu')  # a torn last line
    m = pg.measure([tmp_path])  # a run directory works as well as its events.jsonl
    assert (m.spawn_s, m.load_memory_s, m.detect_s) == (20.0, 0.5, pg.Measured().detect_s)  # detection: built in
    assert m.reform_s == pytest.approx(2.0)  # the wait for the replacement and the re-forming, together
    assert m.sources["spawn_s"] == "median of 3" and m.sources["reform_s"] == "median of 2"
    assert "load_durable_s" not in m.sources  # no durable resume: the built-in value stays
    slower = pg.recovery(m, pg.Assumptions(), 1024)["memory"][0]
    assert slower > pg.recovery(pg.Measured(), pg.Assumptions(), 1024)["memory"][0] + 19


def test_without_events_it_says_it_uses_built_in_values(capsys):
    assert pg.main(["--gpus", "1024,100000"]) == 0
    out = capsys.readouterr().out
    assert "built-in defaults (no events file given" in out
    assert len([line for line in out.splitlines() if line.startswith("| 1")]) == 8


def test_an_events_file_without_records_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("not json\n")
    assert pg.main([str(tmp_path / "events.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no ledger events" in err


def test_a_missing_events_file_exits_2_with_one_line_and_no_traceback(tmp_path):
    missing = tmp_path / "nope" / "events.jsonl"
    p = subprocess.run([sys.executable, str(SCRIPT), str(missing)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and str(missing) in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == ""
