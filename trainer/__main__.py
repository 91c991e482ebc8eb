"""Command line: `python -m trainer CONFIG [key=value ...]`, identical under
`torchrun --nproc-per-node N -m trainer CONFIG [key=value ...]`."""

from __future__ import annotations

import sys

from trainer.runtime import protocol

USAGE = """usage: python -m trainer CONFIG [key=value ...]
       torchrun --nproc-per-node N -m trainer CONFIG [key=value ...]

Trains the model described by CONFIG (a YAML file, see configs/) with any key overridden on the
command line, e.g. `python -m trainer configs/smoke.yaml train.steps=20 run.dir=runs/try`.
A run resumes from the newest committed checkpoint in checkpoint.dir unless checkpoint.resume=never."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return protocol.EXIT_OK if argv else protocol.EXIT_USAGE
    # Imported here so that `--help` and config errors answer before torch loads.
    from trainer.config import ConfigError, load
    from trainer.observability.wandb_log import check_installed

    try:
        cfg = load(argv[0], argv[1:])
        check_installed(cfg.log.wandb)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return protocol.EXIT_USAGE
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

    from common.errors import peer_lost
    from common.storage import caused_by_storage
    from data.shards import CorruptShardError, NotADatasetError, ShardError
    from data.stream import DataStateError
    from trainer.checkpoint import CheckpointError, IncompatibleCheckpointError
    from trainer.health.check import FaultyRank
    from trainer.loop import train
    from trainer.runtime.fault import Preempted
    from trainer.runtime.lease import DirectoryInUse
    from trainer.step import NonFiniteError

    try:
        record(train)(cfg)  # an unexpected exception lands in torchelastic's error file for the launcher
    except Preempted as e:
        print(f"[rekindle] {e}", file=sys.stderr)
        return protocol.EXIT_PREEMPTED
    except FaultyRank as e:  # its node is set aside (the launcher does not restart it)
        print(f"error: {e}", file=sys.stderr)
        ErrorHandler().record_exception(e)
        return protocol.EXIT_FAULTY
    except (ConfigError, ShardError, DataStateError, CheckpointError, NonFiniteError, DirectoryInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        ErrorHandler().record_exception(e)  # the launcher's ledger names the cause (no-op without torchrun)
        # Input that no restart can fix exits EXIT_USAGE, which the launcher does not restart; storage
        # that could not be used (within storage.*'s bounds) may come back: EXIT_STORAGE.
        bad_input = (ConfigError, DataStateError, NotADatasetError, CorruptShardError, IncompatibleCheckpointError,
                     DirectoryInUse)
        if isinstance(e, bad_input):
            return protocol.EXIT_USAGE
        return protocol.EXIT_STORAGE if caused_by_storage(e) else protocol.EXIT_FAILED
    except Exception as e:
        if caused_by_storage(e) is not None:
            print(f"error: storage could not be used: {type(e).__name__}: {e}", file=sys.stderr)
            return protocol.EXIT_STORAGE  # (record() above has left the error in torchelastic's error file)
        if not peer_lost(e):
            raise
        # Another rank's failure: its own output says why; this one's traceback would only bury that.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"[rekindle] a peer rank is gone ({type(e).__name__}: {first_line[:300]}); exiting for the launcher "
              "to restart the group", file=sys.stderr)
        return protocol.EXIT_FAILED
    return protocol.EXIT_OK


if __name__ == "__main__":
    from common.process import exit_now

    exit_now(main())
