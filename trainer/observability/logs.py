"""One output voice per process, through `logging`: the trainer's lines read `[rekindle] ...` (rank 0
says everything; other ranks only warnings and errors, prefixed with their rank), the launcher's
`[launch] ...`. Warnings and errors say so (`warning: ...`, `error: ...`). Metrics records do not go
through here: they stay in `metrics.jsonl` (trainer.observability.metrics).

Modules log to `logging.getLogger("rekindle.<module>")` (the trainer) or `"launch"`; `setup` is
called once, by the process's entry point. While a progress bar is on screen, lines are written
through tqdm so the bar is redrawn below them instead of being torn."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

TRAINER = "rekindle"
LAUNCHER = "launch"


def get_logger(module: str = "", root: str = TRAINER) -> logging.Logger:
    """The logger of `module` under `root` (the trainer's by default)."""
    return logging.getLogger(f"{root}.{module}" if module else root)


class _Formatter(logging.Formatter):
    def __init__(self, voice: str, rank: int | None) -> None:
        super().__init__()
        self.prefix = f"[{voice}] " + (f"rank {rank}: " if rank else "")

    def format(self, record: logging.LogRecord) -> str:
        level = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}
        return self.prefix + level.get(record.levelno, "") + record.getMessage()


class _Handler(logging.Handler):
    """Writes through tqdm.write, which clears and redraws any progress bar; to `stream`, or to
    whatever sys.stdout is at the time (so that a redirected or captured stdout gets the lines)."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            stream = self.stream or sys.stdout
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup(root: str = TRAINER, rank: int = 0, verbose: bool = True, stream: TextIO | None = None) -> logging.Logger:
    """Configure the `root` logger of this process: `[root] message` lines on `stream` (the current
    sys.stdout by default); INFO when `verbose` (rank 0), else warnings and errors only, prefixed with `rank`.
    Calling it again replaces the previous set-up (a rank learns its rank after start-up)."""
    logger = logging.getLogger(root)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = _Handler(stream)
    handler.setFormatter(_Formatter(root, None if verbose else rank))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.propagate = False
    return logger
