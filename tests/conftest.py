"""Shared fixtures: a per-session cache for the built-in corpus (shared with child processes), the
loopback S3 server and a fresh bucket on it, the data tests' small dataset, and the losses of a
plain in-process run. Helpers that are not fixtures are in tests/helpers.py (imported by the
fixtures that need them, so that collecting a test does not import torch through this file); the
loopback S3 server itself, the TCP proxy and process-tree kills are in tests/fixtures.py (also used by
scripts/).

Every test under tests/integration/ is marked `slow` here (the quick tier, `-m "not slow"`, is
tests/unit/ less the few unit tests marked slow in place)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parent / "integration"


# The longest test files first (about 20 s and more on a 2-core machine, longest first; the files that
# compile a model lead, being last in the default order): pytest-xdist hands out whole files in the order
# collected, so that the workers then end together on short files instead of one waiting for the other.
LONGEST_FIRST = ("test_perf.py", "test_loss.py", "test_model.py", "test_launch_multinode.py", "test_memory_tier.py",
                 "test_checkpoint_faults.py", "test_slurm.py", "test_warm_restarts.py", "test_train.py",
                 "test_launch_preemption.py", "test_launch_restarts.py", "test_in_process.py", "test_storage_faults.py",
                 "test_data_resume.py", "test_network.py", "test_data_trainer.py", "test_perf_runs.py",
                 "test_export_runs.py", "test_wandb_run.py")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).name, len(rank)))  # stable: the order is kept otherwise


@pytest.fixture(autouse=True)
def rekindle_logging() -> None:
    """The trainer's log lines (`[rekindle] ...`) on the current stdout, as a process of the trainer
    sets them up, so that in-process tests see them (capsys); set up again for every test, since a
    test may have pointed them elsewhere (the exporter's main() says them on stderr)."""
    from trainer.observability import logs

    logs.setup()


@pytest.fixture(scope="session", autouse=True)
def memory_tier_dir() -> Path:
    """The memory tier's default directory for this session's runs (in memory, as /dev/shm's default is,
    so that memory_every=auto turns it on), shared with child processes and removed at the end: runs
    that a test kills leave their snapshots behind."""
    from trainer.checkpoint.memory import MEMORY_DIR_ENV

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    path = base / f"rekindle-tests-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.environ[MEMORY_DIR_ENV] = str(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One built-in corpus cache for the whole session, shared with child processes."""
    path = tmp_path_factory.mktemp("rekindle-cache")
    os.environ["REKINDLE_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint: moto's server on 127.0.0.1, reached over HTTP through s3fs exactly as a
    user's bucket would be (endpoint and credentials in the standard AWS environment variables, which
    child processes inherit)."""
    from tests.fixtures import LoopbackS3

    with LoopbackS3() as s3:
        yield s3.endpoint


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """A fresh, empty bucket; returns its URL (s3://name)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    name = f"rekindle-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return f"s3://{name}"


@pytest.fixture(scope="module")
def local_dataset(tmp_path_factory):
    """helpers.TEXTS prepared into small local shards (one per test module)."""
    from tests.helpers import make_dataset

    return make_dataset(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def plain(cache_dir, tmp_path_factory) -> list[float]:
    """The losses of a short plain run of the smoke config in this process: the reference of the
    speed-option tests."""
    from tests.helpers import SHORT, train_here

    return train_here(tmp_path_factory.mktemp("plain"), SHORT)
