"""Sharded checkpoints with torch.distributed.checkpoint (DCP) on local disk or any fsspec URL:
collective save with an atomic commit, verification with fallback, retention, async saves, resume.

Layout of one checkpoint:
  <dir>/step-00000120/   __<rank>_0.distcp + .metadata   model and optimizer (DCP), resharded on load; each
                                                         tensor chunk stored as its raw bytes (`format`),
                                                         objects torch.save'd
                         train_state.json                step, tokens, data state, RNG per rank, world, config
                                                         hash, tied parameter names, model arguments
                         COMMIT.json                     written last by rank 0: every file with size + checksum
                                                         (xxh3-128), and a sha256 of COMMIT.json's own content
Protocol: every rank writes its shards (rank 0 also `.metadata`), hashing them as they are written;
success is agreed collectively; only then rank 0 writes train_state.json and COMMIT.json (durably, on
a local disk). A step without a valid COMMIT.json is never loaded. On resume every rank verifies its
share of the files of the newest committed step (rank r the shard file of rank r, the one it loads at
an unchanged world size); any missing, truncated, corrupt or unreadable file names itself in a warning
and the previous commit is tried (unreachable storage is an error on every rank instead). A remote
file is downloaded once: verification copies it to a local spool directory while hashing it, and the
load reads the copy. Retention runs after each commit of step s: it keeps the newest `keep` steps up
to s (and keep_every multiples) and deletes the newer steps this run fell back past; a step is
deleted only after a newer one is committed, and a failure while deleting does not undo the commit.

The package, by job:
  format        the raw shard format, its errors, and reading it: DCP readers, safe loading (no code runs)
  writing       DCP writers of the raw (or DCP's own) format, checksumming every file as it is written
  commit        the files of the protocol, no collectives: step dirs, COMMIT.json, verify, list, prune
  spool         local copies of a remote step's verified files, for the load to read
  background    BackgroundWriter: the one writer thread of async saves and of the memory tier
  staging       async saves: the background copy into a reused CPU buffer, and the write
  checkpointer  Checkpointer: the collective save / commit / discover / load
  memory        the memory tier (checkpoint.memory_every): each rank's shard in node-local memory every few
                steps, copies on the next node; a restart prefers it when it is newer
  memory_slots  the memory tier's files on a node: slots, writing a part (header last), the scan that verifies
  memory_state  what a memory-tier part holds of the state (tensors, their layout as bytes), and its restore
  memory_peers  what the memory tier's ranks exchange: the peer copies, the restore plan, the parts sent
  memory_reshard  a memory snapshot of another world size put back in this one (a lost node, another
                --nproc-per-node): each rank reads the rows it now holds from the node's parts
  memory_auto   checkpoint.memory_every=auto: the interval that keeps a snapshot's cost near 1% of the steps,
                or off, saying why (memory_dir on a disk, not enough room)
Fault injection for tests (`REKINDLE_CRASH_AT`) is in trainer.runtime.fault.
"""

from trainer.checkpoint.checkpointer import Checkpointer, tied_parameters
from trainer.checkpoint.commit import (
    COMMIT,
    STEP_DIR,
    TRAIN_STATE,
    TrainState,
    committed_steps,
    read_commit,
    read_train_state,
    step_dir,
    verify,
)
from trainer.checkpoint.format import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    IncompatibleCheckpointError,
    UnsafeCheckpointError,
    load_state,
)

__all__ = [
    "COMMIT", "STEP_DIR", "TRAIN_STATE", "CheckpointError", "CheckpointNotFoundError", "CheckpointStorageError",
    "Checkpointer", "IncompatibleCheckpointError", "TrainState", "UnsafeCheckpointError",
    "committed_steps", "load_state", "read_commit", "read_train_state", "step_dir", "tied_parameters", "verify",
]
