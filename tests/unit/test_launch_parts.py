"""The launcher's parts on their own, in this process: restart policy decisions, which side of a
partition goes on, torchrun's words for --nproc-per-node, goodput accounting, and the Kubernetes
recipe. (The watchdog on real processes, CLI errors and the Slurm recipe:
tests/integration/test_launch_cli.py.)"""

from __future__ import annotations

import os

import pytest
import yaml

from launch.failures import Failure
from launch.ledger import Attempt, Ledger
from launch.liveness import goes_on
from launch.policy import RestartPolicy
from tests.helpers import REPO
from trainer.runtime.protocol import (
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_FAULTY,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    read_events,
)


def kill(step: int, rank: int = 1) -> Failure:
    return Failure(rank, "signal", step, -9, "SIGKILL")


def test_policy_restarts_at_once_after_progress_and_backs_off_without_it():
    policy = RestartPolicy(max_restarts=10, backoff_s=1.0, crash_loop_repeats=5)
    assert policy.decide(kill(30)).delay_s == 0.0
    assert policy.decide(kill(50)).delay_s == 0.0  # got further: no backoff
    assert policy.decide(kill(45)).delay_s == 1.0  # no progress past step 50
    assert policy.decide(kill(48)).delay_s == 2.0
    assert policy.decide(kill(60)).delay_s == 0.0  # progress again


def test_policy_stops_a_crash_loop_before_the_budget_is_spent():
    policy = RestartPolicy(max_restarts=10, crash_loop_repeats=3)
    boom = Failure(1, "exit", 12, 1, message="RuntimeError: boom")
    assert policy.decide(boom).restart and policy.decide(boom).restart
    decision = policy.decide(boom)
    assert not decision.restart and decision.exit_code == EXIT_CRASH_LOOP
    assert "crash loop" in decision.reason and "step 12" in decision.reason and "RuntimeError: boom" in decision.reason
    assert policy.restarts == 2  # 8 of 10 restarts were not wasted


def test_policy_budget_and_bad_input():
    policy = RestartPolicy(max_restarts=1)
    assert policy.decide(kill(5)).restart
    spent = policy.decide(kill(9))
    assert not spent.restart and spent.exit_code == EXIT_FAILED and "budget" in spent.reason
    bad = RestartPolicy(max_restarts=5).decide(Failure(0, "exit", 1, EXIT_USAGE, message="ConfigError: x"))
    assert not bad.restart and bad.exit_code == EXIT_USAGE


def test_the_same_hang_again_and_again_is_a_crash_loop():
    """A hang's message names the pid and how long the rank was stale, which differ every time; its
    key does not, so a deterministic deadlock stops early instead of spending the restart budget."""
    policy = RestartPolicy(max_restarts=10, crash_loop_repeats=3)
    hangs = [Failure(0, "hang", 13, message=f"rank 0 (pid {pid}) is stopped: no step finished for {s}s after step 12",
                     key="rank 0 stopped") for pid, s in ((101, 60.1), (202, 60.4), (303, 60.2))]
    assert policy.decide(hangs[0]).restart and policy.decide(hangs[1]).restart
    assert policy.decide(hangs[2]).exit_code == EXIT_CRASH_LOOP


def test_a_node_whose_ranks_fail_again_and_again_is_set_aside_when_the_job_can_go_on_without_it():
    """`node_failure_limit` failures of ranks here within the window, more than elsewhere meanwhile: set aside
    (EXIT_FAULTY). Not on a job that cannot go on without the node, not for a victim's or a preempted
    rank's exit, not once the failures age out of the window, not when the other nodes fail as often, and
    not before a crash loop (a bug crashes the same way on any node)."""
    now = [0.0]
    policy = RestartPolicy(max_restarts=10, node_failure_limit=3, node_failure_window_s=100, can_set_aside=True,
                           clock=lambda: now[0])
    assert policy.decide(kill(5)).restart and policy.decide(kill(9)).restart
    assert policy.decide(Failure(1, "exit", 11, 1, message="DistNetworkError: Connection reset by peer")).restart
    assert policy.decide(Failure(1, "preemption", 12, EXIT_PREEMPTED)).restart
    assert "failed 3 times" in policy.sets_aside(kill(14))
    aside = policy.decide(kill(14))
    assert (aside.restart, aside.exit_code, aside.set_aside) == (False, EXIT_FAULTY, True)
    assert "failed 3 times in 100 s" in aside.reason and "excluded-nodes" in aside.reason

    alone = RestartPolicy(max_restarts=10, node_failure_limit=3, can_set_aside=False)
    assert all(alone.decide(kill(s)).restart for s in (5, 9, 14))  # one node: nowhere to go on

    now[0], aged = 0.0, RestartPolicy(max_restarts=10, node_failure_limit=3, node_failure_window_s=100,
                                      can_set_aside=True, clock=lambda: now[0])
    for step, at in ((5, 0.0), (9, 50.0), (14, 120.0)):  # the first ages out
        now[0] = at
        assert aged.decide(kill(step)).restart

    shared = RestartPolicy(max_restarts=10, node_failure_limit=2, can_set_aside=True)
    shared.failed_elsewhere()
    assert shared.decide(Failure(0, "node", 3, key="node lost")).restart  # another node lost
    assert shared.decide(kill(5)).restart and shared.decide(kill(9)).restart  # 2 here, 2 elsewhere

    looping = RestartPolicy(max_restarts=10, crash_loop_repeats=3, node_failure_limit=3, can_set_aside=True)
    assert looping.decide(kill(7)).restart and looping.decide(kill(7)).restart
    assert looping.decide(kill(7)).exit_code == EXIT_CRASH_LOOP


def test_the_side_of_a_partition_that_goes_on():
    # A strict majority of the group answering at the store goes on, at any endpoint of the list.
    assert goes_on(2, 3, last_endpoint=False) and goes_on(3, 4, last_endpoint=False)
    # Half of it goes on only where the silent half cannot move on to host a rival group: two nodes at one
    # endpoint, one lost without a word, is one node going on (it ended the job before).
    assert goes_on(1, 2, last_endpoint=True) and goes_on(2, 4, last_endpoint=True)
    assert not goes_on(1, 2, last_endpoint=False) and not goes_on(2, 4, last_endpoint=False)
    # A minority never does.
    assert not goes_on(1, 3, last_endpoint=True) and not goes_on(0, 2, last_endpoint=True)


def test_nproc_per_node_takes_torchruns_words():
    from launch.__main__ import nproc_per_node

    assert nproc_per_node("3") == 3
    assert nproc_per_node("cpu") == (os.cpu_count() or 1)
    assert nproc_per_node("auto") == (os.cpu_count() or 1)  # no GPU here: the CPUs
    with pytest.raises(ValueError):
        nproc_per_node("gpu")  # asked for GPUs, there are none
    with pytest.raises(ValueError):
        nproc_per_node("many")


def test_goodput_counts_only_steps_that_survived(tmp_path):
    ledger = Ledger(tmp_path, started=0.0)
    # attempt 0 ran steps 1..50 in 50s; the next attempt resumed from 40: steps 41..50 were lost.
    ledger.attempts = [Attempt(0, 0.0, resumed_step=0, last_step=50, busy_s=50.0, steps_run=50),
                       Attempt(1, 60.0, resumed_step=40, last_step=100, busy_s=60.0, steps_run=60)]
    assert ledger.productive_s() == pytest.approx(40.0 + 60.0)
    ledger.resumes = [{"step": 40, "lost_steps": 10, "recovery_s": 5.0}]
    summary = ledger.summary(ended=125.0)
    assert summary["goodput"] == pytest.approx(100 / 125, abs=1e-4)
    assert summary["lost_s"] == pytest.approx(5.0 + 10.0)  # the recovery, and the 10 steps redone
    assert summary["steps_kept"] == 100


def test_the_done_event_carries_the_outcome_and_with_a_price_the_cost(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.attempts = [Attempt(0, ledger.started, resumed_step=10, last_step=30, busy_s=2.0, steps_run=20)]
    summary = ledger.done(3, "crash loop", devices=2, tokens_per_step=1024, price=2.5)
    done = read_events(tmp_path)[-1]
    assert (done["event"], done["exit_code"], done["outcome"], done["steps_kept"]) == ("done", 3, "crash loop", 20)
    assert done["cost"] == summary["cost"]
    cost = done["cost"]
    assert (cost["devices"], cost["tokens"], cost["price_per_device_hour"]) == (2, 20 * 1024, 2.5)
    ledger.done(0, "done")
    assert "cost" not in read_events(tmp_path)[-1]


def test_rendezvous_settings_and_ids():
    from launch import rendezvous

    fixed = rendezvous.settings(2, 2, {})
    assert "last_call_timeout" not in fixed and fixed["join_timeout"] == "900"
    assert rendezvous.settings(1, 2, {})["last_call_timeout"] == "3"  # elastic: do not wait 30s for late nodes
    assert rendezvous.settings(1, 2, {"join_timeout": "60"})["join_timeout"] == "60"  # --rdzv-conf wins
    job = rendezvous.run_id("demo", "runs/demo", standalone=False)
    assert job == rendezvous.run_id("demo", "runs/demo", standalone=False)  # every node of the job agrees
    assert job != rendezvous.run_id("demo", "runs/other", standalone=False)
    assert rendezvous.run_id("demo", "runs/demo", standalone=True) != rendezvous.run_id("demo", "runs/demo", True)

def test_a_starting_launcher_meets_the_others_where_a_store_listens():
    """--rdzv-endpoint A,B,C: the first start meets at A; a launcher replacing a lost node meets at the
    first later endpoint where something listens (the job moved down the list)."""
    import socket
    import time

    from launch.rendezvous import endpoints, first_answering

    listening = socket.create_server(("127.0.0.1", 0))
    free = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    closed = [f"127.0.0.1:{s.getsockname()[1]}" for s in free]
    for s in free:
        s.close()
    there = f"127.0.0.1:{listening.getsockname()[1]}"
    try:
        assert endpoints(f" {closed[0]}, {closed[1]},{there} ") == [closed[0], closed[1], there]
        assert endpoints("") == []
        started = time.monotonic()
        assert first_answering([closed[0], closed[1], there]) == 2
        assert first_answering([closed[0], closed[1]]) == 0  # nobody anywhere: the job's first start
        assert first_answering([there]) == 0  # one endpoint is never asked
        assert time.monotonic() - started < 3
    finally:
        listening.close()


def test_how_a_launcher_ends_is_one_line_with_its_exit_code():
    """launch.outcome: a lost rendezvous store is a requeue (75) naming the endpoint, never exit 1; a job that
    finished elsewhere (its final step committed) is exit 0 for a spare; the rest as before."""
    from torch.distributed import DistNetworkError

    from launch.outcome import ended
    from launch.policy import Decision

    lost = DistNetworkError("Broken pipe")
    assert ended(True, False, None, None, "h:1", 1, True, None) == (0, "done")
    code, line = ended(False, False, lost, None, "h:2", 2, True, None)
    assert code == 75 and line.startswith("the rendezvous endpoint h:2 (the last of --rdzv-endpoint) stopped "
                                          "answering") and "\n" not in line
    assert "(the last of" not in ended(False, False, lost, None, "h:1", 1, True, None)[1]
    assert ended(False, True, None, None, "h:1", 1, False, 40) == (
        0, "the job finished (step 40 committed) while this node waited to join: nothing left to do here")
    assert ended(False, False, lost, None, "h:1", 1, True, 40)[0] == 0
    assert ended(False, True, None, None, "h:1", 1, False, None)[0] == 1
    assert ended(False, False, RuntimeError("x"), None, "h:1", 1, True, None) == (1, "launcher error: RuntimeError: x")
    stop = Decision(False, exit_code=3, reason="loop\nmore")
    assert ended(False, False, None, stop, "h:1", 1, True, None) == (3, "loop")


def test_kubernetes_recipe_is_an_elastic_pytorchjob():
    docs = list(yaml.safe_load_all((REPO / "launch" / "cluster" / "pytorchjob.yaml").read_text()))
    job = next(d for d in docs if d and d.get("kind") == "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    policy = spec["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["minReplicas"] <= policy["maxReplicas"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    command = " ".join(container["command"] + container.get("args", []))
    assert container["name"] == "pytorch" and "launch" in command
    assert worker["template"]["spec"]["terminationGracePeriodSeconds"] >= 30  # room for the emergency checkpoint


def test_a_checkpoint_store_that_does_not_answer_is_not_waited_for(tmp_path, monkeypatch):
    """A preempted launcher asks the store whether the emergency checkpoint was committed: a store that
    accepts the request and never answers costs at most the timeout, and counts as not committed."""
    import time

    from launch.commits import newest_commit
    from trainer.checkpoint import commit

    monkeypatch.setattr(commit, "committed_steps", lambda root: time.sleep(30))
    start = time.monotonic()
    assert newest_commit(str(tmp_path), timeout_s=0.5) is None
    assert time.monotonic() - start < 5
    monkeypatch.setattr(commit, "committed_steps", lambda root: [])
    assert newest_commit(str(tmp_path), timeout_s=5) is None  # answered: nothing committed


def test_torchrun_spellings_are_accepted_and_its_other_options_refused_by_name(monkeypatch):
    from launch.__main__ import main, parse_args, refused_torchrun_option, torchrun_conflicts

    args = parse_args(["--nproc_per_node=2", "--standalone", "--node_rank", "0", "--rdzv_backend", "c10d",
                       "--max_restarts", "3", "c.yaml", "train.steps=5"])
    assert (args.nproc_per_node, args.max_restarts, args.config, args.overrides) == ("2", 3, "c.yaml",
                                                                                      ["train.steps=5"])
    assert torchrun_conflicts(args) == ""
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    args = parse_args(["c.yaml"])
    assert args.node_rank == "1" and "'etcd' is not supported" in torchrun_conflicts(args)
    assert "--standalone is one node" in torchrun_conflicts(
        parse_args(["--standalone", "--rdzv-endpoint", "h:1", "--rdzv-backend", "c10d", "c.yaml"]))
    for option in ("--master_addr=h", "--master-port", "--log-dir", "--tee", "--redirects", "-m"):
        assert f"torchrun's {option.split('=')[0]} is not supported" in refused_torchrun_option(
            ["--nproc-per-node", "2", option, "c.yaml"])
    assert main(["--log_dir=/tmp/x", "c.yaml"]) == 2


def test_a_torn_error_file_of_a_killed_rank_is_dropped_and_a_whole_one_kept(tmp_path):
    """A rank SIGKILLed while writing its error file leaves it torn; torchelastic's ProcessFailure raises
    on it (JSONDecodeError), which ended the agent (exit 1) in a benchmark run."""
    from launch.failures import drop_torn_error_file

    torn, whole = tmp_path / "torn.json", tmp_path / "whole.json"
    torn.write_text('{"message": {"message": "RuntimeError: Connection reset')
    whole.write_text('{"message": "ok"}')
    for path in (torn, whole, tmp_path / "missing.json"):
        drop_torn_error_file(str(path))
    assert not torn.exists() and whole.exists()
