"""Where bytes live, for the data pipeline and the checkpoints alike: fsspec file systems for local
paths and URLs (`s3://`, `memory://`, ...), the one test of "is this storage local", whole-file
writes (atomic, and durable or exclusive where asked: every writer of a local file that others read
while it is written uses `atomic_write` or `atomic_file`), checksums, and the one classification of
"the storage could not be used" errors (`storage_error`), so that every caller reports an unreachable
endpoint as one line naming the URL. Torch-free."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import fsspec
import xxhash

from common.errors import exception_chain

LOCAL_CHUNK = 8 << 20
# Object stores: bytes per GET when verifying or loading a file. Each request costs a round trip (and
# on moto's server a read of the whole object), so a checkpoint shard file of up to this size is one GET;
# the price is that much memory per rank while it is read.
REMOTE_CHUNK = 128 << 20
CHECKSUM = "xxh3_128"  # the algorithm new checkpoints record, as the key of each file's entry
CHECKSUMS = (CHECKSUM, "sha256")  # what verification understands


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system of a local path or URL, and the path within it."""
    return fsspec.core.url_to_fs(url)


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_local(where: str | fsspec.AbstractFileSystem) -> bool:
    """Whether a path/URL (or an fsspec file system) is the local disk: a plain path or `file://`."""
    if isinstance(where, str):
        return "://" not in where or where.startswith("file://")
    return "file" in protocols(where)


def local_path(url: str) -> str:
    """The plain path of a local path or `file://` URL."""
    return url.removeprefix("file://")


def join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


# Packages whose exceptions mean "the object store could not be used" (connection refused or timed
# out, bad credentials, a throttled or broken endpoint); a missing file is FileNotFoundError instead.
STORE_CLIENTS = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "azure")


def bound_requests(timeout_s: float) -> None:
    """Give every S3 request this process makes from now on (s3fs, DCP's fsspec reader and writer) a
    connect and read timeout of `timeout_s`, through fsspec's configuration of the `s3` protocol; keys
    the user set there (FSSPEC_S3 in the environment) win."""
    import fsspec.config

    s3 = fsspec.config.conf.setdefault("s3", {})
    kwargs = dict(s3.get("config_kwargs") or {})
    kwargs.setdefault("connect_timeout", timeout_s)
    kwargs.setdefault("read_timeout", timeout_s)
    s3["config_kwargs"] = kwargs


def storage_error(e: BaseException) -> BaseException | None:
    """The one classification of "the storage could not be used": the error in `e`'s chain (itself, its
    causes, the contexts it did not suppress) that says so, or None. In this order:

    - a FileNotFoundError anywhere in the chain: None. A missing file is an answer of working storage,
      which its caller handles as such (a step without its commit, a path that is not a dataset);
    - a PermissionError (refused permissions or credentials; s3fs turns AccessDenied into one): that
      error. The storage was reached and said no, so the error is the storage's: it is reported in one
      line naming the URL (`unreachable_as`), and verification never takes a step it may not read for a
      corrupt one (falling back past it, and deleting it later). No retry makes a permission appear,
      though, so it is not storage that may come back (`caused_by_storage`);
    - an error raised by an object store's client or fsspec, a StorageUnavailable (a stall, a
      CheckpointStorageError), or a ConnectionError or TimeoutError that the system raised (it has an
      errno: a refused or reset connection, a network mount that timed out): that error. A TimeoutError
      that code raised with a message only is not the storage's (a rendezvous store that did not answer)."""
    chain = list(exception_chain(e))
    if any(isinstance(link, FileNotFoundError) for link in chain):
        return None
    for link in chain:
        if isinstance(link, PermissionError):
            return link
    for link in chain:
        client = type(link).__module__.split(".")[0] in (*STORE_CLIENTS, "fsspec")
        system = isinstance(link, (ConnectionError, TimeoutError)) and link.errno is not None
        if client or system or isinstance(link, StorageUnavailable):
            return link
    return None


def caused_by_storage(e: BaseException) -> BaseException | None:
    """`storage_error(e)` when the storage may come back (not a refused permission), else None: what makes
    a rank exit EXIT_STORAGE (restarted with backoff) rather than failed."""
    link = storage_error(e)
    return None if isinstance(link, PermissionError) else link


class StorageUnavailable(Exception):  # noqa: N818 - a kind of error, mixed into the callers' own
    """Mixed into an error that says storage could not be reached or used: it may come back."""


class StorageStalled(TimeoutError, StorageUnavailable):
    """A storage operation did not finish within its bound."""


class StallWatch:
    """Bounds blocking storage work in this process: `with watch.guard(what, url): ...` that runs longer
    than `limit_s` calls `on_stall(message)` from the watch's thread (the blocked call itself cannot be
    interrupted: a write to an endpoint that stopped reading waits forever), with a message naming
    what was being done and the URL. One thread per watch, started on first use; `limit_s` 0: no bound."""

    def __init__(self, limit_s: float, on_stall: Callable[[str], None]) -> None:
        self.limit_s, self.on_stall = limit_s, on_stall
        self._active: dict[int, tuple[float, str]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, what: str, url: str) -> Iterator[None]:
        if not self.limit_s:
            yield
            return
        key = next(self._ids)
        with self._lock:
            self._active[key] = (time.monotonic() + self.limit_s, f"{what} ({url})")
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="storage-stall-watch", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(key, None)

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.limit_s / 4)):
            now = time.monotonic()
            with self._lock:
                stalled = [what for deadline, what in self._active.values() if deadline <= now]
            if stalled:
                self.on_stall(f"storage stalled: no answer within storage.stall_s={self.limit_s:g}s while "
                              f"{stalled[0]}")
                return

    def close(self) -> None:
        self._closed.set()


@contextlib.contextmanager
def unreachable_as(error: type[Exception], what: str) -> Iterator[None]:
    """Inside: an exception that says the storage could not be used (`storage_error`) is raised again as
    `error("<what>: <type>: <message>")`; any other exception, and an `error` already, passes unchanged."""
    try:
        yield
    except Exception as e:
        if isinstance(e, error) or storage_error(e) is None:
            raise
        raise error(f"{what}: {type(e).__name__}: {e}") from e


def fsync_dir(path: str) -> None:
    """Make the entries of local directory `path` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    """A name beside `path` for a file (or socket) that is renamed to `path` once complete: this host, this
    process and a random part, so that writers on two hosts sharing a file system (which may have the same
    pid), two processes or two threads never write into one temp file. The host's first label only, at
    most 16 characters: a Unix socket's path has at most 107 bytes."""
    host = socket.gethostname().split(".", 1)[0][:16]
    return f"{path}.tmp-{host}-{os.getpid()}-{secrets.token_hex(4)}"


def leftover_temps(path: str) -> list[str]:
    """The `temp_name` files beside local `path` that writers killed mid-write left behind (none when its
    directory is gone)."""
    folder, name = os.path.split(path)
    try:
        return [os.path.join(folder, n) for n in os.listdir(folder or ".") if n.startswith(f"{name}.tmp-")]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def atomic_file(path: str, *, durable: bool = False, exclusive: bool = False) -> Iterator[BinaryIO]:
    """A new local file, written in the block, that appears at `path` whole when the block ends, or not
    at all: a temp file beside it (`temp_name`), renamed over `path`, and removed on any failure, the
    block's own included. `durable`: the file and then its directory are fsynced, so that once the block
    ends the file survives a crash of the machine. `exclusive`: only where no file is at `path`
    (FileExistsError otherwise): the temp file is hard-linked there, so of two writers exactly one
    succeeds. An OSError names the file."""
    tmp = temp_name(path)
    try:
        with open(tmp, "xb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        (os.link if exclusive else os.replace)(tmp, path)  # a link fails where a file is
    except BaseException as e:  # e.g. a full disk: leave nothing behind, and say which file it was
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"writing {path}: {e.strerror or e}") from e
        raise
    if exclusive:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # its other name: the file is at `path`
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


def atomic_write(path: str | os.PathLike, data: bytes, *, durable: bool = False, exclusive: bool = False) -> None:
    """Write local file `path` whole, so that no reader ever sees it half-written (`atomic_file`)."""
    with atomic_file(os.fspath(path), durable=durable, exclusive=exclusive) as f:
        f.write(data)


def write_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes, durable: bool = False,
               exclusive: bool = False) -> None:
    """Write a file whole, so that no reader ever sees it half-written. Local: `atomic_write`. Object
    stores: one PUT, whole (and durable) once acknowledged; `exclusive` (FileExistsError where a file is
    at `path`): If-None-Match."""
    if is_local(fs):
        atomic_write(local_path(path), data, durable=durable, exclusive=exclusive)
    elif exclusive:
        fs.pipe_file(path, data, mode="create")  # If-None-Match: *
    else:
        with fs.open(path, "wb") as f:
            f.write(data)


def write_durably(url: str, data: bytes) -> None:
    """`write_file(..., durable=True)` at a path or URL."""
    fs, path = filesystem(url)
    write_file(fs, path, data, durable=True)


def new_digest(algorithm: str = CHECKSUM) -> Any:
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksum_bytes(data: bytes, algorithm: str = CHECKSUM) -> str:
    digest = new_digest(algorithm)
    digest.update(data)
    return digest.hexdigest()


class SpoolError(OSError):
    """The local copy of a remote file could not be written (disk full, no temp directory)."""


def checksum_file(fs: fsspec.AbstractFileSystem, path: str, algorithm: str = CHECKSUM,
                  copy_to: str | None = None) -> str:
    """The checksum of file `path` in `fs`, read in large chunks. Object stores: one request per
    `REMOTE_CHUNK` bytes, no read-ahead copy: every request costs a round trip, so a file verifies
    faster in fewer, larger GETs (docs/performance.md, "Data loading and checkpoint I/O").
    With `copy_to`, the bytes read are also written to that local file; a failure to write it raises
    SpoolError (remote errors pass as they are)."""
    digest = new_digest(algorithm)
    size = LOCAL_CHUNK if is_local(fs) else REMOTE_CHUNK
    try:
        dst = open(copy_to, "wb") if copy_to else contextlib.nullcontext()  # noqa: SIM115 - closed below
    except OSError as e:
        raise SpoolError(f"cannot write {copy_to}: {e}") from e
    with dst, fs.open(path, "rb", block_size=size, cache_type="none") as f:
        while chunk := f.read(size):
            digest.update(chunk)
            if copy_to:
                try:
                    dst.write(chunk)
                except OSError as e:
                    raise SpoolError(f"cannot write {copy_to}: {e}") from e
    return digest.hexdigest()
