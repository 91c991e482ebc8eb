"""Straggler scoring and its reporting rule (trainer.observability.stragglers), the per-rank work of a log window
(trainer.observability.metrics.LogWindow), the slow-rank fault hook, and the per-step fault-tolerance rules that
replaced per-step work: the heartbeat written once per step, the preemption agreement on one rank."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import SMOKE
from trainer.config import ConfigError, LogConfig, TrainConfig, load
from trainer.observability.metrics import LogWindow, PendingRecords, RecordDraft, StepTimer
from trainer.observability.stragglers import StragglerWatch, straggler_scores
from trainer.runtime import fault, protocol


def test_a_score_is_the_ranks_time_over_the_median_of_the_other_ranks():
    assert straggler_scores([0.1]) == [1.0]
    assert straggler_scores([0.1, 0.1]) == [1.0, 1.0]
    assert straggler_scores([0.1, 0.3]) == pytest.approx([1 / 3, 3.0])  # median of all (0.2) would say 1.5
    assert straggler_scores([1.0, 1.0, 1.0, 2.0]) == [1.0, 1.0, 1.0, 2.0]
    assert straggler_scores([1.0, 0.0]) == [1.0, 0.0]  # nothing measured for the others: no score


def test_a_rank_is_reported_once_when_slow_over_a_period_and_once_when_it_recovers():
    """Periods of at least 1 s of whole log windows (here 0.4 s each): the score over a period decides."""
    watch = StragglerWatch(factor=1.5, period_s=1.0)
    reported = []
    windows = [[1.0, 2.0]] * 6 + [[1.0, 1.0]] * 3 + [[1.0, 2.0]] * 2
    for window, times in enumerate(windows):
        scores, changes = watch.update(times, steps=4, elapsed_s=0.4)
        assert watch.update(times, steps=4, elapsed_s=5.0, judged=False) == (scores, [])  # not counted
        assert scores == straggler_scores(times)  # each window's own, for the record
        reported += [(window, c.rank, c.status, c.score, c.time_s, c.others_s, c.period_s) for c in changes]
    assert reported == [(2, 1, "slow", 2.0, 2.0, 1.0, pytest.approx(1.2)),  # windows 0-2: the first period
                        (8, 1, "recovered", 1.0, 1.0, 1.0, pytest.approx(1.2))]  # 6-8 (3-5 slow: no change)
    assert watch.flagged == set()  # windows 9-10 are not a whole period yet


def test_a_few_slow_steps_in_a_period_and_detection_off_report_nothing():
    watch = StragglerWatch(factor=1.5, period_s=1.0)
    for times in [[1.0, 2.5], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]] * 5:  # one slow step a period: 1.375x over it
        assert watch.update(times, steps=1, elapsed_s=0.25)[1] == []
    off = StragglerWatch(factor=0.0, period_s=0.1)
    assert not off.enabled and off.update([1.0, 9.0], 10, 1.0)[1] == [] and not off.flagged


def test_straggler_settings_are_validated():
    assert load(SMOKE, ["fault.straggler_factor=0"]).fault.straggler_factor == 0
    with pytest.raises(ConfigError, match="straggler_factor"):
        load(SMOKE, ["fault.straggler_factor=1.0"])
    with pytest.raises(ConfigError, match="straggler_s"):
        load(SMOKE, ["fault.straggler_s=0"])


def test_the_slow_rank_hook_names_a_rank_a_delay_and_a_step_range(monkeypatch):
    assert protocol.slow_rank("") is None
    assert protocol.slow_rank("1:0.25") == (1, 0.25, 1, None)
    assert protocol.slow_rank("0:2@5-9") == (0, 2.0, 5, 9)
    monkeypatch.setenv(protocol.SLOW_RANK_ENV, "1:0.5@3-4")
    assert [fault.slowdown(step, 1) for step in range(1, 7)] == [0, 0, 0.5, 0.5, 0, 0]
    assert fault.slowdown(3, 0) == 0.0
    monkeypatch.delenv(protocol.SLOW_RANK_ENV)
    assert fault.slowdown(3, 1) == 0.0


def test_log_windows_are_exchanged_in_one_gather_and_give_means_and_each_ranks_own_work():
    """Two closed windows, one asynchronous gather of both rows: the means as before, and each rank's
    data wait + compute per step, without its wait in collectives (a fast rank waits for the slow one)."""
    timer = StepTimer(torch.device("cpu"))
    timer.window = lambda: {"fwd_bwd_s": 0.5, "optim_s": 0.1, "comm_wait_s": 0.4}  # this rank's, per step
    peer = [3.0, 0.04, 1.5, 0.2, 0.0] * 2  # the other rank's rows: loss, data wait per step, fwd/bwd, optim, comm
    sent, written = [], []

    def gather(values):  # starts the collective; the function returned waits for it
        sent.append(values)
        return lambda: [values, peer]

    window, records = LogWindow(timer), PendingRecords(gather, lambda draft, means: written.append(means))
    for step, losses in ((1, [2.0, 4.0]), (2, [1.0, 3.0])):
        for loss, wait in zip(losses, (0.02, 0.06), strict=True):
            window.add(loss, wait)
        records.add(RecordDraft(step, window.close(), {}, first=False))
        window.restart()
    # What a memory snapshot taken now carries, and gives back when loaded: the same drafts.
    carried = [RecordDraft.from_json(json.loads(json.dumps(d.to_json()))) for d in records.unwritten()]
    assert [(d.step, d.window, d.restored) for d in carried] == [(1, records.queued[0].window, True),
                                                                (2, records.queued[1].window, True)]
    assert not sent and not written  # nothing goes out until the loop says so
    records.send()
    assert sent == [[3.0, 0.04, 0.5, 0.1, 0.4, 2.0, 0.04, 0.5, 0.1, 0.4]] and not written
    assert [d.step for d in records.unwritten()] == [1, 2]  # in flight: not written yet
    records.receive()
    assert [w["loss"] for w in written] == [3.0, 2.5]  # each window its own slice of the rows
    out = written[1]
    assert out["data_wait_s"] == pytest.approx(0.04)
    assert out["fwd_bwd_s"] == pytest.approx(1.0) and out["comm_wait_s"] == pytest.approx(0.2)
    assert out["rank_work_s"] == pytest.approx([0.64, 1.74])
    records.send()
    records.receive()  # nothing queued, nothing in flight
    assert len(sent) == 1 and len(written) == 2


def test_a_heartbeat_that_changes_nothing_but_the_time_is_not_rewritten(tmp_path, monkeypatch):
    """One write per step: the step's beat; the 'back to training' beat after it is a no-op unless
    the rank was evaluating or saving (a phase change) or the file is REFRESH_S old."""
    monkeypatch.setenv(protocol.HEARTBEAT_DIR_ENV, str(tmp_path))
    beat = protocol.Heartbeat(rank=0)
    writes = []
    write = beat._write
    monkeypatch.setattr(beat, "_write", lambda: (writes.append(beat.record.to_json()), write()))
    beat.beat("train", step=1, busy_s=0.1)
    beat.beat("train")  # nothing new
    beat.beat("train", step=2, busy_s=0.2)
    beat.beat("save")
    beat.beat("train")  # back from the save: a phase change
    beat.beat("train")
    assert [(w["phase"], w["step"]) for w in writes] == [("train", 1), ("train", 2), ("save", 2), ("train", 2)]
    beat._written -= protocol.REFRESH_S
    beat.beat("train")
    assert len(writes) == 5
    on_disk = json.loads((tmp_path / "rank-0.json").read_bytes().decode().strip())
    assert on_disk["step"] == 2 and on_disk["phase"] == "train" and on_disk["t"] == writes[-1]["t"]
    beat.close()


def test_one_rank_stops_at_the_next_boundary_and_never_at_the_last_step():
    flag = fault.PreemptionFlag()
    try:
        cpu = torch.device("cpu")
        assert not flag.agreed(1, 1, cpu)
        flag._handler(15, None)
        assert flag.received and flag.agreed(2, 1, cpu) and not flag.agreed(3, 1, cpu, last=True)
    finally:
        flag.close()


def test_ranks_agree_about_every_quarter_second_on_fast_steps_and_every_step_on_slow_ones():
    assert fault.steps_between_checks(0.03) == 8  # 8 x 30 ms
    assert fault.steps_between_checks(0.001) == fault.steps_between_checks(0.0) == fault.MAX_STEPS_BETWEEN
    assert fault.steps_between_checks(0.3) == 1  # pipelined: the stop comes one step later
    assert fault.steps_between_checks(0.5) == fault.steps_between_checks(30.0) == 0  # blocking, every step


def test_the_metrics_log_keeps_its_file_open_and_ends_a_torn_line_first(tmp_path):
    from trainer.observability.metrics import MetricsLog

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # a writer killed mid-line
    metrics = MetricsLog(str(tmp_path), TrainConfig(steps=10), LogConfig(progress=False), 2, enabled=True)
    for step in (3, 4):
        metrics.log({"step": step, "loss": 1.0, "lr": 0.1, "tokens_per_s": 1.0, "mfu": 0.0})
        assert [r["step"] for r in protocol.read_jsonl(tmp_path / "metrics.jsonl")] == [1, *range(3, step + 1)]
    metrics.close()
