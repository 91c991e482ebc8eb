"""In-process recovery, the ranks' side (fault.in_process, under `python -m launch`): a rank that loses a
peer keeps its process and goes on with the survivors and the launcher's replacements. The launcher's
side is launch/recovery/ (through trainer.contract).

    inplace    recover(): leave the failed generation, wait for the ranks, re-form, restore, go on; a
               replacement's setup from the survivors; a smaller world after a lost node
    regroup    Regroup: the groups' connections, leaving a generation, forming the next one under the same
               names; noticing another rank's failure (the watch thread); the launcher's store
    keys       every key on the coordination store and the generation arithmetic (torch-free, shared with
               the launcher)
    grad_norm  the global gradient norm from each rank's own shards: warm in a replacement rank, whose
               DTensor caches are cold
"""
