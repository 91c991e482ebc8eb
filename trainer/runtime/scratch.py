"""Per-process scratch directories in a temp directory, named after their process, so that those a
process left when it was killed outright are swept by the next one: `<prefix><pid namespace>-<pid>-...`
(a pid means something only inside its pid namespace: containers sharing one temp directory may each
have a process 42). The checkpoint spool's (`rekindle-ckpt-`) and the fork server's socket directories
(`rekindle-zygote-`, through trainer.contract). Torch-free."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from common.process import is_alive


def _namespace(prefix: str) -> str:
    """`<prefix><pid namespace>-`: the names of this pid namespace's directories."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{prefix}{namespace}-"


def scratch_prefix(prefix: str, pid: int | None = None) -> str:
    """`<prefix><pid namespace>-<pid>-`: the name prefix of process `pid`'s directories (default: this one)."""
    return f"{_namespace(prefix)}{os.getpid() if pid is None else pid}-"


def sweep_scratch(prefix: str, *parents: str) -> None:
    """Remove the directories named `scratch_prefix(prefix, pid)...` in `parents` (default: the temp
    directory) whose process (of this pid namespace) no longer exists."""
    ours = _namespace(prefix)
    for parent in dict.fromkeys(parents or (tempfile.gettempdir(),)):
        with contextlib.suppress(OSError):
            for entry in os.scandir(parent):
                pid = entry.name.removeprefix(ours).split("-", 1)[0]
                if entry.name.startswith(ours) and pid.isdigit() and not is_alive(int(pid)):
                    shutil.rmtree(entry.path, ignore_errors=True)
