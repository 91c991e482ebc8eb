"""The bottom of the project: primitives that trainer/, data/ and launch/ all use, one copy each. It
imports nothing of theirs (a unit test holds it to that), and nothing of torch.

    storage   where bytes live: fsspec file systems, whole-file (atomic, durable) writes, checksums,
              the one classification of "the storage could not be used", the stall watch
    process   process life: exit_now, is_alive, /proc reads, send_signal (the one signal helper) and kill_group, dying
              with a parent
    exits     the exit codes of a rank and of the launcher
    clock     bounded waits: wait_until (poll until a deadline), call_bounded (a call on a thread, bounded)
    errors    the exception-chain walk, and the one "a peer rank is gone" classifier (exceptions and texts)
    net       whether anything listens at host:port, once or until a bound
    exclusion the run's nodes set aside: run.dir/excluded-nodes
    timing    every fixed time (`*_S`) of the trainer and the launcher, and their orderings, checked
"""
