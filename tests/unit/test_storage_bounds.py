"""Bounds on storage (common.storage): the stall watch, which errors are the storage's, and which of those
mean "storage may come back"."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from common import storage
from trainer.checkpoint import CheckpointError, CheckpointStorageError


def test_a_stalled_operation_is_reported_once_naming_what_and_where():
    said: list[str] = []
    fired = threading.Event()
    watch = storage.StallWatch(0.4, lambda message: (said.append(message), fired.set()))
    try:
        with watch.guard("reading training data", "s3://b/ds"):
            time.sleep(0.05)  # well within the bound: nothing said
        assert not said
        with watch.guard("writing a checkpoint", "s3://b/ck/step-00000020"):
            assert fired.wait(5)
        assert said == ["storage stalled: no answer within storage.stall_s=0.4s while writing a checkpoint "
                        "(s3://b/ck/step-00000020)"]
    finally:
        watch.close()


def test_no_bound_means_no_watch_thread():
    watch = storage.StallWatch(0, lambda message: None)
    with watch.guard("anything", "s3://b"):
        pass
    assert watch._thread is None


def test_storage_errors_are_told_from_bad_input_and_bugs():
    from botocore.exceptions import EndpointConnectionError

    refused = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    try:
        raise CheckpointError("cannot reach checkpoint storage s3://b") from refused
    except CheckpointError as e:
        assert storage.caused_by_storage(e) is refused
    assert storage.caused_by_storage(CheckpointStorageError("listing s3://b: ...")) is not None
    assert storage.caused_by_storage(storage.StorageStalled("stalled")) is not None
    for other in (FileNotFoundError("s3://b/x"), CheckpointError("corrupt"), ValueError("bug")):
        assert storage.caused_by_storage(other) is None
    # s3fs turns NoSuchKey / AccessDenied into FileNotFoundError / PermissionError caused by botocore's
    # error: a missing object or refused credentials are not storage that may come back.
    from botocore.exceptions import ClientError

    for translated in (FileNotFoundError, PermissionError):
        try:
            try:
                raise translated("s3://b/x") from ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
            except OSError as e:
                raise CheckpointError("cannot read s3://b/x") from e
        except CheckpointError as e:
            assert storage.caused_by_storage(e) is None, translated
    try:
        try:
            raise refused
        except EndpointConnectionError:
            raise CheckpointError("corrupt") from None  # the context is suppressed: not a storage error
    except CheckpointError as e:
        assert storage.caused_by_storage(e) is None


def test_requests_get_timeouts_unless_the_user_set_their_own(monkeypatch):
    import fsspec.config

    monkeypatch.setattr(fsspec.config, "conf", {"s3": {"config_kwargs": {"read_timeout": 99}}})
    storage.bound_requests(7.0)
    assert fsspec.config.conf["s3"]["config_kwargs"] == {"read_timeout": 99, "connect_timeout": 7.0}


def test_a_refused_permission_is_the_storages_error_but_does_not_come_back():
    refused = PermissionError(errno.EACCES, "Access Denied")
    assert storage.storage_error(refused) is refused and storage.caused_by_storage(refused) is None
    with pytest.raises(CheckpointStorageError, match="cannot read s3://b/ck: PermissionError") as raised:
        with storage.unreachable_as(CheckpointStorageError, "cannot read s3://b/ck"):
            raise refused
    assert storage.caused_by_storage(raised.value) is None  # one line naming the URL, and no retrying
    mount = TimeoutError(errno.ETIMEDOUT, "Connection timed out")  # the system's: a network mount
    assert storage.caused_by_storage(mount) is mount
    assert storage.storage_error(TimeoutError("rank 0's process-group store did not accept connections")) is None
    for passing in (FileNotFoundError("s3://b/ck/step-00000010/COMMIT.json"), CheckpointError("corrupt"),
                    CheckpointStorageError("cannot reach s3://b")):
        with pytest.raises(type(passing)) as raised:
            with storage.unreachable_as(CheckpointStorageError, "cannot read s3://b/ck"):
                raise passing
        assert raised.value is passing
