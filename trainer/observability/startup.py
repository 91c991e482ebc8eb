"""What a restarted rank need not measure again. Under the launcher, a value a rank measured at its
first start (the matmul peak that MFU is reported against) is kept in the launcher's heartbeat
directory, which lives as long as the launcher, and the ranks of later worker groups read it instead
of measuring again. Without the launcher (plain torchrun or one process) every start measures.
Torch-free."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import storage
from trainer.runtime.protocol import HEARTBEAT_DIR_ENV


def remembered(key: str, measure: Callable[[], Any]) -> Any:
    """`measure()` (a JSON value) the first time `key` is asked for under this launcher; what that
    returned, afterwards. `key` names what was measured and under which conditions (a file name)."""
    directory = os.environ.get(HEARTBEAT_DIR_ENV)
    if not directory:
        return measure()
    path = Path(directory) / f"memo-{key}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return json.loads(path.read_text())["value"]
    value = measure()
    with contextlib.suppress(OSError):  # whole or not at all, for a rank reading it at the same moment
        storage.atomic_write(path, json.dumps({"value": value}).encode())
    return value
