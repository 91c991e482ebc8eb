"""Writing checkpoint shards: DCP storage writers (local paths and fsspec URLs) that store each tensor
chunk in the raw shard format (trainer.checkpoint.format describes it) or in DCP's own, and checksum
every file as its bytes go out, so a save never reads its own files back."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from common import storage
from trainer.checkpoint.format import ALIGN, RAW_FORMAT, CheckpointError, byte_view
from trainer.distributed.torch_compat import FsspecWriter, StorageInfo

# A write fault hook: called with the bytes written so far to one shard file, after each write.
Fault = Callable[[int], None]


class _DigestStream:
    """A write-only file wrapper that checksums what passes through it, on the writing thread. (Not
    on a helper thread overlapped with the write: its GIL hand-offs cost more than the overlap saves;
    docs/performance.md, "Data loading and checkpoint I/O".)"""

    def __init__(self, raw: Any, fault: Fault | None) -> None:
        self.raw, self.fault, self.size, self.digest = raw, fault, 0, storage.new_digest()

    def write(self, b: Any) -> int:
        view = memoryview(b)
        self.digest.update(view)
        self.raw.write(view)
        self.size += view.nbytes
        if self.fault is not None:
            self.fault(self.size)
        return view.nbytes

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()


class _DigestingFileSystem:
    """Mixin for DCP's FileSystem classes: every `.distcp` file written records {size, checksum}, and
    so does `.metadata` (written as `.metadata.tmp`, then renamed: recorded under its final name)."""

    digests: dict[str, dict[str, Any]]
    fault: Fault | None

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            name = str(path).rstrip("/").rsplit("/", 1)[-1]
            shard = name.endswith(dcp_fs.DEFAULT_SUFFIX)
            if "w" not in mode or not (shard or name.endswith(".metadata.tmp")):
                yield stream
                return
            out = _DigestStream(stream, self.fault if shard else None)
            yield out
            self.digests[name.removesuffix(".tmp")] = {"size": out.size, storage.CHECKSUM: out.digest.hexdigest()}


def _digesting(fs: Any, fault: Fault | None) -> Any:
    """The writer's own FileSystem object `fs`, as an instance of a subclass that hashes what it writes."""
    cls = type(f"Digesting{type(fs).__name__}", (_DigestingFileSystem, type(fs)), {})
    out = cls.__new__(cls)
    out.__dict__.update(vars(fs))
    out.digests, out.fault = {}, fault
    return out


class _RawWriterMixin:
    """For DCP's FileSystemWriter and FsspecWriter: one shard file per rank, tensors written in
    RAW_FORMAT. DCP's own writer calls torch.save per tensor (a zip archive each, a pickle, several
    small records); for a few hundred tensors that costs more than writing their bytes. With
    `standard` set, DCP's own write_data runs instead (still hashed by `_DigestingFileSystem`)."""

    fs: Any
    path: Any
    sync_files: bool
    standard: bool = False

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.standard:
            return super().write_data(plan, planner)  # type: ignore[misc]
        name = f"{plan.storage_data.prefix}0{dcp_fs.DEFAULT_SUFFIX}"
        results: list[WriteResult] = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            at = 0
            for item in sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO):  # stable: objects first
                if item.type == WriteItemType.BYTE_IO:
                    data = memoryview(planner.resolve_data(item).getbuffer())
                    formats = None
                else:
                    tensor = planner.resolve_data(item).detach()
                    want, dtype = item.tensor_data.chunk.sizes, item.tensor_data.properties.dtype
                    if tuple(tensor.shape) != tuple(want) or tensor.dtype != dtype:  # what .metadata will say
                        raise CheckpointError(f"{item.index.fqn}: tensor {list(tensor.shape)} {tensor.dtype}, planned "
                                              f"{list(want)} {dtype}")
                    data = byte_view(tensor.cpu().resolve_conj().resolve_neg().contiguous())  # no copies if it is
                    formats = (RAW_FORMAT,)
                    if pad := -at % ALIGN:
                        stream.write(bytes(pad))
                        at += pad
                stream.write(data)
                results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes,
                                           storage_data=StorageInfo(name, at, data.nbytes, formats)))
                at += data.nbytes
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut


class _LocalWriter(_RawWriterMixin, dcp.FileSystemWriter):
    pass


class _FsspecWriter(_RawWriterMixin, FsspecWriter):
    pass


FORMATS = ("raw", "dcp")  # checkpoint.format: RAW_FORMAT tensors | DCP's own (torch.save per tensor)


def writer(url: str, fault: Fault | None = None, fmt: str = "raw") -> dcp.FileSystemWriter:
    """A DCP writer for a local path or fsspec URL whose `.digests` maps each file it wrote (its shard;
    `.metadata` too on the coordinator) to {size, checksum}. `fmt` "raw": RAW_FORMAT shards; "dcp":
    DCP's standard format, which stock tools (`dcp.load`, `format_utils.dcp_to_torch_save`) read. Local
    shards are fsynced; object stores have nothing to sync (an upload is whole)."""
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format {fmt!r}: expected one of {', '.join(FORMATS)}")
    w = _LocalWriter(storage.local_path(url)) if storage.is_local(url) else _FsspecWriter(url, sync_files=False)
    w.standard = fmt == "dcp"
    w.fs = _digesting(w.fs, fault)
    w.digests = w.fs.digests
    return w
