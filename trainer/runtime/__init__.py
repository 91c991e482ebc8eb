"""The training process's life under a supervisor: what it promises the launcher and how it behaves
when things go wrong.

    protocol      the contract with the launcher: env vars, exit codes, heartbeat records, events.jsonl
    fault         preemption (SIGTERM, agreed by every rank), dying with the launcher, injected faults
    lease         one job per run.dir / checkpoint.dir (LEASE.json, renewed; stale ones taken over)
    scratch       per-process temp directories, and the sweep of those whose process is gone
    memory_sweep  where the memory tier's snapshots live on a node, and the launcher's sweep of those of runs
                  whose run.dir is gone or that are older than checkpoint.memory_max_age_h
    host          the host's memory settings: malloc tuning and transparent huge pages
"""
