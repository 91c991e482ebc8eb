"""Failure attribution on hand-built inputs (no processes): which rank's failure is the root cause,
what it is called, and what the ledger gets from torchelastic's error-file data."""

from __future__ import annotations

from launch import failures
from launch.failures import Failure, RankExit
from launch.policy import RestartPolicy
from launch.watchdog import Hang
from trainer.runtime.protocol import EXIT_PREEMPTED, EXIT_STORAGE, HeartbeatRecord

CALLSTACK = "".join(f'  File "trainer/loop.py", line {n}, in frame{n}\n' for n in range(10))


def error(message: str, callstack: str = CALLSTACK) -> dict:
    """Error-file data as torchelastic's ErrorHandler writes it for an uncaught exception."""
    return {"message": {"message": message, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n{callstack}{message}\n", "timestamp": "100"}}}


def raised(rank: int, message: str, when: float, local_rank: int | None = None) -> RankExit:
    return RankExit(rank, rank if local_rank is None else local_rank, 1, when, error(message))


def killed(rank: int, when: float, sig: int = 9) -> RankExit:
    return RankExit(rank, rank, -sig, when)


PEER = "torch.distributed.DistBackendError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"


def test_a_killed_rank_is_the_cause_even_after_its_peers_reported_errors():
    exits = {0: raised(0, PEER, when=10.0), 1: killed(1, when=11.0), 2: raised(2, "RuntimeError: boom", when=9.0)}
    assert failures.root_cause(exits, victims=set()).rank == 1


def test_an_exception_of_its_own_beats_an_earlier_lost_peer_error():
    exits = {0: raised(0, PEER, when=10.0), 1: raised(1, "ValueError: bad batch\nmore", when=12.0)}
    assert failures.root_cause(exits, victims=set()).rank == 1


def test_among_failures_of_one_kind_the_earliest_then_the_lowest_rank_is_blamed():
    later, earlier = raised(0, "RuntimeError: a", when=20.5), raised(3, "RuntimeError: b", when=20.25)
    assert failures.root_cause({0: later, 3: earlier}, victims=set()).rank == 3
    tied = {2: raised(2, "RuntimeError: a", when=5.0), 1: raised(1, "RuntimeError: b", when=5.0)}
    assert failures.root_cause(tied, victims=set()).rank == 1


def test_ranks_torn_down_by_the_agent_are_victims_unless_nothing_else_failed():
    # local rank 0 was still running when the group was closed; it was then SIGKILLed (the agent's
    # fast close): that signal must not make it the cause of the exception on rank 1
    exits = {0: killed(0, when=10.0), 1: raised(1, "RuntimeError: boom", when=11.0)}
    assert failures.root_cause(exits, victims={0}).rank == 1
    assert failures.root_cause(exits, victims=set()).rank == 0
    only_victims = {0: killed(0, when=3.0), 1: raised(1, PEER, when=2.0)}
    assert failures.root_cause(only_victims, victims={0, 1}).rank == 0


def test_victims_are_local_ranks_not_global_ones():
    # on the second node global ranks 2 and 3 are local ranks 0 and 1
    exits = {2: RankExit(2, 0, -9, 10.0), 3: raised(3, "RuntimeError: boom", when=11.0, local_rank=1)}
    assert failures.root_cause(exits, victims={0}).rank == 3
    assert failures.root_cause(exits, victims={1}).rank == 2


def test_an_exit_without_an_error_file_is_deliberate_and_blamed_before_a_lost_peer():
    exits = {0: raised(0, PEER, when=1.0), 1: RankExit(1, 1, 2, when=4.0)}  # exit 2 (bad input): no traceback
    assert failures.root_cause(exits, victims=set()).rank == 1
    assert failures.blame_order(RankExit(1, 1, 1, 4.0, {"message": ""}))[0] == 2  # an error file with nothing in it


def test_the_message_is_the_first_line_and_the_traceback_its_last_lines():
    data = error("RuntimeError: injected failure at step 12\nsecond line")
    assert failures.first_line(data) == "RuntimeError: injected failure at step 12"
    assert failures.first_line({"message": "  plain text reply\nmore"}) == "plain text reply"
    assert failures.first_line(None) == "" and failures.first_line({"message": "   "}) == ""
    tail = failures.traceback_tail(data, lines=3).splitlines()
    assert tail == ['  File "trainer/loop.py", line 9, in frame9', "RuntimeError: injected failure at step 12",
                    "second line"]
    assert failures.traceback_tail({"message": "no call stack in a plain reply"}) == ""
    assert failures.traceback_tail(None) == ""


def test_lost_peer_errors_are_recognised():
    assert failures.lost_peer(PEER)
    assert failures.lost_peer("RuntimeError: [Rank 1]: Watchdog caught collective operation timeout: Timed out")
    assert not failures.lost_peer("RuntimeError: injected failure at step 12")


def test_the_failure_names_the_cause_and_the_step_it_was_on():
    beats = {0: HeartbeatRecord(rank=0, step=40), 1: HeartbeatRecord(rank=1, step=41)}
    failure, tb = failures.from_exits({0: raised(0, PEER, 2.0), 1: killed(1, 3.0)}, set(), beats, last_step=7)
    assert failure == Failure(1, "signal", 42, -9, "SIGKILL") and tb == ""
    assert failure.describe() == "rank 1 was killed by SIGKILL at step 42"

    failure, tb = failures.from_exits({1: raised(1, "RuntimeError: boom", 3.0)}, set(), {}, last_step=7)
    assert (failure.cause, failure.step, failure.exit_code, failure.message) == ("exit", 8, 1, "RuntimeError: boom")
    assert tb.endswith("RuntimeError: boom") and len(tb.splitlines()) == 6

    failure, tb = failures.from_exits({0: RankExit(0, 0, EXIT_PREEMPTED, 3.0)}, set(), {0: HeartbeatRecord(step=5)}, 0)
    assert (failure.cause, failure.step, failure.message, tb) == ("preemption", 6, "", "")


def test_a_preemption_names_the_rank_that_got_the_signal():
    """SIGTERM to rank 1 alone: both ranks commit and exit 75; rank 1's heartbeat says it was signalled."""
    exits = {r: RankExit(r, r, EXIT_PREEMPTED, 3.0 + r) for r in (0, 1)}
    beats = {0: HeartbeatRecord(rank=0, step=5), 1: HeartbeatRecord(rank=1, step=5, signalled=True)}
    failure, _ = failures.from_exits(exits, set(), beats, 0)
    assert (failure.rank, failure.cause, failure.step) == (1, "preemption", 6)
    beats[1].signalled = True  # rank 0 exited first and ended the group, rank 1 had not exited yet
    assert failures.from_exits({0: exits[0]}, set(), beats, 0)[0].rank == 1
    beats[1].signalled = False  # nobody on this node got it (the signal went to another node's rank)
    assert failures.from_exits(exits, set(), beats, 0)[0].rank == 0


def test_the_same_hang_with_another_pid_is_the_same_failure_for_the_policy():
    hangs = [failures.from_hang(Hang(rank=1, pid=pid, step=12, stale_s=stale, state="stopped"))
             for pid, stale in ((101, 60.1), (202, 60.4), (303, 61.0))]
    assert hangs[0].step == 13 and hangs[0].cause == "hang" and "pid 101" in hangs[0].message
    assert len({h.signature() for h in hangs}) == 1
    policy = RestartPolicy(max_restarts=10, crash_loop_repeats=3)
    assert [policy.decide(h).restart for h in hangs] == [True, True, False]
    spinning = failures.from_hang(Hang(rank=1, pid=404, step=12, stale_s=60.0, state="spinning"))
    assert spinning.signature() != hangs[0].signature()


def test_the_same_exception_raised_in_the_same_place_is_the_same_failure_whatever_its_message_says():
    """A KeyError of an object's id (a new address every attempt), blamed on rank 1, then on rank 0:
    the same failure (exception type and the innermost frames of this project's code), so a crash loop.
    Another type, or the same type raised elsewhere, is another failure."""
    root = failures.PROJECT_ROOT

    def stack(*frames: tuple[str, int, str]) -> str:
        return "".join(f'  File "{path if path.startswith("/") else root / path}", line {line}, in {fn}\n'
                       for path, line, fn in frames)

    here = stack(("trainer/loop.py", 120, "train"), ("/venv/site-packages/torch/utils/data/x.py", 5, "f"),
                 ("trainer/checkpoint/memory.py", 125, "local_tensors"))
    loop = [failures.from_exits({rank: RankExit(rank, rank, 1, 3.0, error(f"KeyError: {address}", here))}, set(),
                                {rank: HeartbeatRecord(rank=rank, step=120)}, 0)[0]
            for rank, address in ((1, 140505901709648), (0, 1405059))]
    assert loop[0].key == "KeyError at trainer/checkpoint/memory.py:125:local_tensors < trainer/loop.py:120:train"
    assert loop[0].signature() == loop[1].signature() and loop[0].message != loop[1].message
    policy = RestartPolicy(max_restarts=10, crash_loop_repeats=3)
    assert [policy.decide(f).restart for f in (*loop, loop[0])] == [True, True, False]

    other = [error("ValueError: 7", here), error("KeyError: 7", stack(("trainer/loop.py", 99, "resume")))]
    assert len({loop[0].key, *(failures.failure_key(e) for e in other)}) == 3
    # No traceback: the first line, its numbers (pids, addresses, ports) left out.
    assert failures.failure_key({"message": "RuntimeError: at 0x7f3a pid 4242"}) == "RuntimeError: at N pid N"
    assert Failure(0, "exit", 5, 1, message="lost 127.0.0.1:4001").signature() == \
        Failure(1, "exit", 5, 1, message="lost 127.0.0.1:4002").signature()


def test_storage_failures_back_off_past_the_crash_loop_rule_and_end_with_exit_4():
    """A rank that exits 4 (storage unusable or stalled, within storage.*'s bounds) is a storage failure,
    named in one line without a traceback; storage may come back, so the same failure again is no crash
    loop: restarts back off until the budget is spent, and the launcher then exits 4."""
    error = {"message": "StorageStalled: storage stalled: no answer within storage.stall_s=6s while writing a "
                        "checkpoint (s3://b/ck/step-00000020)"}
    failure, tb = failures.from_exits({0: RankExit(0, 0, EXIT_STORAGE, 3.0, error)}, set(),
                                      {0: HeartbeatRecord(step=19)}, 0)
    assert (failure.cause, failure.step, tb) == ("storage", 20, "")
    assert "could not use its storage" in failure.describe() and "s3://b/ck/step-00000020" in failure.describe()
    policy = RestartPolicy(max_restarts=4, backoff_s=1.0, crash_loop_repeats=2)
    decisions = [policy.decide(failure) for _ in range(5)]
    assert [d.restart for d in decisions] == [True, True, True, True, False]
    assert [d.delay_s for d in decisions[:4]] == [0.0, 1.0, 2.0, 4.0]  # no progress: backing off
    assert decisions[-1].exit_code == EXIT_STORAGE and "restart budget spent" in decisions[-1].reason


def test_a_hang_while_saving_names_the_checkpoint_store_and_waits_for_the_ranks_own_bound(tmp_path):
    hang = failures.from_hang(Hang(rank=0, pid=7, step=19, stale_s=61.0, state="waiting", phase="save"), "s3://b/ck")
    assert hang.cause == "hang" and "while saving a checkpoint" in hang.message and "s3://b/ck" in hang.message
    # The watchdog gives a rank in a save storage.stall_s (+ margin) before calling it hung: the rank's
    # own bound fires first, and names the URL (exit 4, cause storage).
    from launch.watchdog import Watchdog

    dog = Watchdog(tmp_path, hang_timeout_s=10, save_timeout_s=100)
    assert (dog._limit("train"), dog._limit("save"), dog._limit("preempt"), dog._limit("eval")) == (10, 100, 100, 10)
