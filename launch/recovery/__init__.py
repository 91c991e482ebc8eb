"""The launcher's recovery: one owner for every recovery decision on a node.

    coordinator  the state machine: events in, actions out; asks the restart policy (no I/O of its own)
    states       its states (Idle, Pending, HangKilled, Recorded, Told) and the node's Mode
    events       what it takes (a rank exited, a hang, nodes silent, a tick) and gives (replace, kill, restart, stop)
    store        the launcher's side of the ranks' coordination store: tell the ranks, hear another launcher,
                 publish a smaller world
"""
