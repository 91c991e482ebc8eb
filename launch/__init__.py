"""The launcher: `python -m launch` supervises torchrun's elastic agent on each node.

    __main__     the command line; options: what it asked for (LaunchOptions)
    supervisor   one node's launcher: composes the parts below
    recovery/    every recovery decision on a node: the coordinator (a state machine), its events, the store
    actions      how the supervisor carries out the coordinator's actions (the only place they touch the world)
    nodes        membership (composed into the supervisor): the endpoint list, spares, silent nodes
    liveness     whether the launchers of a job still hear each other: counters on the rendezvous store
    preemption   SIGTERM to the launcher: passed to the ranks, the grace period, a second signal
    outcome      the exit code and its one line; commits: what the checkpoint store says was committed
    agent        torchrun's LocalElasticAgent with the supervisor's hooks; it adopts another agent's running
                 ranks when the store moves (with rounds, the only files touching torchelastic's internals);
                 agent_hooks: what it shares with the supervisor
    rounds       what torch's private rendezvous state says: the round, each node's ranks, nodes that left;
                 a spare's way out of torch's join loop
    spares       spares that join in process: the spare's registration and claims on the ranks' store
    rendezvous   the c10d rendezvous (loopback-only store on one node; an ordered endpoint list to move down
                 when the node hosting one is lost) and the worker spec
    zygote, stub warm restarts: the fork server ranks are forked from, and the stub torchelastic starts
    failures     failure attribution: pure functions over what torchelastic reported
    watchdog     hang detection from the ranks' heartbeat records
    policy       restart, back off, or stop (budget, crash loop, bad input)
    ledger       events.jsonl and the end-of-run accounting (goodput, cost)
    lock         who owns run.dir: one job's launchers at a time
    cluster/     Slurm and Kubernetes recipes
"""
