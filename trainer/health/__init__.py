"""Faults that crash nothing: silent data corruption, loss spikes, a faulty rank. A step whose loss or
gradient norm is anomalous, or one a spot check picks, is computed again before its update, and the ranks'
results compared bit for bit (a run is bit-identical to an uninterrupted one, so a healthy replay agrees):

    anomaly   the rule: far above the recent range by a robust measure, or non-finite
    replay    each rank's fingerprint of a step's results (loss and gradient bits), gathered and compared;
              each rank's micro-batches computed on another rank, and what names a rank wrong from that
    check     anomaly -> replay -> verdict: data at fault (skipped), a transient corruption (redone), a
              faulty rank (ended, its node set aside)
    exclusion a faulty node set aside: run.dir/excluded-nodes and the ledger
    inject    test-only hooks that flip gradient bits or make a rank compute wrong (no-ops unless their
              environment variable is set)"""
