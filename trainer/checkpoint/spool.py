"""The spool: local copies of a remote checkpoint step's files, written while verification downloads
and checksums them, and read by the load instead of downloading them again (so the bytes loaded are
the bytes verified). One spool directory per process in the temp directory, named after the process
(`rekindle-ckpt-<pid namespace>-<pid>-...`, trainer.runtime.scratch); those of processes that no longer
exist (a rank killed while verifying) are swept when the next one is made."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

from trainer.runtime.scratch import scratch_prefix, sweep_scratch

_PREFIX = "rekindle-ckpt-"


def spool_prefix(pid: int | None = None) -> str:
    """Name prefix of the spool directories of process `pid` (default: this one)."""
    return scratch_prefix(_PREFIX, pid)


class Spool:
    """At most one step's verified local copies at a time; removed by `drop()`, by the next `open()`,
    or at exit at the latest."""

    def __init__(self) -> None:
        self._current: tuple[int, str, weakref.finalize] | None = None

    def open(self, step: int) -> str | None:
        """A fresh, empty spool directory for `step` (None without a usable temp directory)."""
        self.drop()
        sweep_scratch(_PREFIX)  # those of processes that no longer exist
        try:
            directory = tempfile.mkdtemp(prefix=spool_prefix())
        except OSError:  # no temp directory: verify remotely, load remotely
            return None
        self._current = (step, directory, weakref.finalize(self, shutil.rmtree, directory, True))
        return directory

    def files(self, step: int) -> dict[str, str]:
        """{file name: local path} of the copies held for `step` ({} for any other step)."""
        if self._current is None or self._current[0] != step:
            return {}
        directory = self._current[1]
        return {name: os.path.join(directory, name) for name in os.listdir(directory)}

    def drop(self) -> None:
        if self._current is not None:
            self._current[2]()
            self._current = None
