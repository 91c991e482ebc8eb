"""The checkpoint file format, its errors, and reading it: DCP storage readers (local paths and fsspec
URLs) for the raw shard format, and loading that cannot run code. The writers, which checksum the
shards while they write them, are trainer.checkpoint.writing. These two modules are the ones that know
DCP's storage layer (its private parts come from trainer.distributed.torch_compat).

Shard format: the checkpoint is a DCP checkpoint (`.metadata` + one `__<rank>_0.distcp` per rank,
planned, resharded and loaded by DCP), but the writer here stores each tensor chunk as its raw bytes
(row-major, at a 64-byte aligned offset) instead of DCP's `torch.save` per tensor, a zip archive
each; for a few hundred tensors that cost more than writing their bytes. Each such item's storage
entry in `.metadata` says where (file, offset, length) and carries the transform descriptor
RAW_FORMAT; its dtype and shape are those of its chunk in `.metadata`. Non-tensor items (optimizer
hyper-parameters, step counters) are `torch.save`d as DCP does. The readers here read RAW_FORMAT
items straight into the destination tensors (only the rows needed when resharding along dim 0) and
leave items without a descriptor, i.e. checkpoints written in DCP's own format by earlier versions, to
DCP's reader. DCP's stock reader does not know the descriptor and raises instead of misreading.

Writers hash every shard file and `.metadata` as their bytes go out, so a save never reads its own
files back. The checksum is xxh3-128: it detects corruption (bit flips, truncation, a wrong file) as
well as a cryptographic hash, and hashes much faster than sha256, which alone cost about as much as
writing the bytes (docs/performance.md, "Data loading and checkpoint I/O"). Raw tensor bytes have
no structure that a flipped bit could break, so the checksums (verified before a step is used) are
what catches it.
Tampering is not what they guard against: whoever can rewrite a shard can rewrite COMMIT.json too;
what keeps a forged checkpoint from running code is the unpickling below. Verification also accepts
sha256 entries.
DCP unpickles two things with plain pickle: `.metadata` (`pickle.load`) and non-tensor items such
as optimizer hyper-parameters (`torch.load(..., weights_only=False)`), so a crafted checkpoint
could run arbitrary code on load. Here `.metadata` is unpickled with an allow-list of the handful of
classes DCP metadata is made of, and non-tensor items with `weights_only=True`; anything else is
refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.futures import Future

from common import storage
from trainer.distributed.torch_compat import FsspecReader

# The storage format of tensor items written here: the tensor's bytes, row-major, nothing else. Its
# dtype and shape are the chunk's in `.metadata`. A transform descriptor as far as DCP is concerned:
# a stock DCP reader does not know it and raises instead of misreading the bytes.
RAW_FORMAT = "rekindle-raw-v1"
ALIGN = 64  # tensor data starts at a multiple of this within the shard file
# DCP's CheckpointException derives from BaseException, not Exception.
SAVE_ERRORS = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used."""


class CheckpointStorageError(CheckpointError, storage.StorageUnavailable):
    """The checkpoint storage could not be reached or used (it may come back: exit code 4)."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint of another model (shape or arguments) than this run's. Bad input: no restart can fix it."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint where one was named (a tool's argument). Bad input."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose metadata or data references code outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    _DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _ALLOWED = {
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
        ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in self._DCP_MODULES and isinstance(getattr(__import__(module, fromlist=[name]), name, None), type):
            return super().find_class(module, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"checkpoint metadata references {module}.{name}, which is not allowed")


def load_metadata(data: bytes) -> Metadata:
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def _readinto(stream: Any, start: int, view: memoryview, what: str) -> None:
    """Fill `view` with the bytes of `stream` from `start` on; a short file is an error."""
    stream.seek(start)
    done = 0
    while done < view.nbytes:
        n = stream.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{what}: the file ends {view.nbytes - done} bytes short (truncated?)")
        done += n


def _narrow(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The box of `t` at `offsets` with `lengths` (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(dim, start, length)
    return t


def set_element(root: dict, path: tuple, value: Any) -> None:
    """Put `value` at `path` (dict keys and list indices) in the nested `root`, making the dicts and
    lists on the way: DCP's flattening of a state dict, undone for one item."""
    node: Any = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
        if last:
            node[key] = value
        else:
            if (node[key] if isinstance(node, list) else node.get(key)) is None:
                node[key] = [] if isinstance(path[i + 1], int) else {}
            node = node[key]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor `t` (shared, not copied), writable."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _SafeReaderMixin:
    """For DCP's FileSystemReader and FsspecReader: `.metadata` unpickled with an allow-list, tensor
    items in RAW_FORMAT read straight into their destination, everything else (non-tensor items, and
    tensors of checkpoints written in DCP's own format by earlier versions) read by DCP."""

    def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, *args, **kwargs)
        self._tensor_metadata = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        """Read the items of each file in file order, each file once. (DCP reads them in plan order,
        which jumps back and forth, and through s3fs's read-ahead cache a backward jump fetches again.)
        Tensors in DCP's own format (checkpoints of earlier versions) are left to DCP's reader."""
        def where(item: ReadItem) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        mine: dict[str, list[ReadItem]] = {}
        legacy = []
        for item in sorted(plan.items, key=where):
            info = self.storage_data[item.storage_index]
            formats = tuple(info.transform_descriptors or ())
            if (item.type, formats) in ((LoadItemType.TENSOR, (RAW_FORMAT,)), (LoadItemType.BYTE_IO, ())):
                mine.setdefault(info.relative_path, []).append(item)
            elif formats:
                raise CheckpointError(f"checkpoint item {item.storage_index.fqn} is stored as {formats}, "
                                      "a format this version does not read")
            else:
                legacy.append(item)
        if legacy:
            super().read_data(dataclasses.replace(plan, items=legacy), planner).wait()
        for name, items in mine.items():
            with self._open(name, items) as stream:
                for item in items:
                    if item.type == LoadItemType.BYTE_IO:
                        info = self.storage_data[item.storage_index]
                        data = bytearray(info.length)
                        _readinto(stream, info.offset, memoryview(data), f"checkpoint item {item.storage_index.fqn}")
                        planner.load_bytes(item, io.BytesIO(data))
                    else:
                        self._read_raw(stream, item, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _open(self, name: str, items: list[ReadItem]) -> Any:
        """A file to read `items` from: the verified local copy when there is one (`local`). Remote:
        a read-ahead block that covers every item (up to `storage.REMOTE_CHUNK`), so a shard file is fetched
        in one GET instead of one per s3fs block."""
        if name in getattr(self, "local", {}):
            return open(self.local[name], "rb")  # noqa: SIM115 - the caller closes it
        path = self.fs.concat_path(self.path, name)
        fs = getattr(self.fs, "fs", None)
        if fs is None or storage.is_local(fs):
            return self.fs.create_stream(path, "rb")
        extent = max(info.offset + info.length for info in (self.storage_data[i.storage_index] for i in items))
        block = max(1, min(extent, storage.REMOTE_CHUNK))
        return fs.open(os.fspath(path), "rb", block_size=block, cache_type="readahead")

    def _stored_chunk(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]]:
        md = self._tensor_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint item {index.fqn} is stored raw but its metadata is not a tensor's")
        chunks = md.chunks
        hint = index.index
        if hint is not None and hint < len(chunks) and chunks[hint].offsets == index.offset:
            return md.properties.dtype, tuple(chunks[hint].sizes)
        for chunk in chunks:
            if chunk.offsets == index.offset:
                return md.properties.dtype, tuple(chunk.sizes)
        raise CheckpointError(f"checkpoint item {index.fqn} has no chunk at {tuple(index.offset or ())}")

    def _read_raw(self, stream: Any, item: ReadItem, planner: Any) -> None:
        """One RAW_FORMAT item: only the bytes of the requested box when it is a run of whole rows of
        the stored chunk (always, for FSDP's dim-0 shards), read into the destination tensor itself
        when that is a contiguous CPU tensor of the same dtype."""
        info = self.storage_data[item.storage_index]
        fqn = item.storage_index.fqn
        dtype, sizes = self._stored_chunk(item.storage_index)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(sizes) * itemsize != info.length:
            raise CheckpointError(f"checkpoint item {fqn} has {info.length} bytes, its metadata says "
                                  f"{list(sizes)} x {dtype}")
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise CheckpointError(f"checkpoint item {fqn}: destination {list(target.shape)}, read {list(lengths)}")
        if offsets[1:] == (0,) * len(offsets[1:]) and lengths[1:] == sizes[1:]:  # whole rows (or a scalar)
            first_row = offsets[0] if sizes else 0
            start = info.offset + first_row * itemsize * math.prod(sizes[1:])
            nbytes, shape = math.prod(lengths) * itemsize, lengths
        else:
            start, nbytes, shape = info.offset, info.length, sizes
        if nbytes == 0:
            planner.commit_tensor(item, target)
            return
        if target.is_cpu and target.dtype == dtype and target.is_contiguous() and shape == lengths:
            _readinto(stream, start, byte_view(target), f"checkpoint item {fqn}")
        else:
            buf = bytearray(nbytes)
            _readinto(stream, start, memoryview(buf), f"checkpoint item {fqn}")
            src = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
            if shape != lengths:
                src = _narrow(src, offsets, lengths)
            target.copy_(src)
        planner.commit_tensor(item, target)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeReaderMixin, dcp.FileSystemReader):
    pass


class SafeFsspecReader(_SafeReaderMixin, FsspecReader):
    pass


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, except that non-tensor items are unpickled with `weights_only=True`
    (plain numbers, strings, tuples, lists, dicts); DCP's own planner uses `weights_only=False`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint item {fqn} is not plain data, refused: {e}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def reader(url: str, local: dict[str, str] | None = None) -> dcp.FileSystemReader:
    """A safe DCP reader of checkpoint `url`; `local` maps file names of a remote checkpoint to
    verified local copies, read instead of the remote files."""
    if storage.is_local(url):
        return SafeFileSystemReader(storage.local_path(url))
    r = SafeFsspecReader(url)
    r.local = dict(local or {})
    return r


def describe_error(e: BaseException, rank: int) -> str:
    """One line for an error on `rank`. DCP's CheckpointException carries (exception, traceback) of the
    ranks that failed, and reaches every rank: name those ranks, not the one reporting it."""
    if isinstance(e, CheckpointException) and e.failures:
        return "; ".join(describe_error(f[0] if isinstance(f, tuple) else f, r) for r, f in sorted(e.failures.items()))
    return f"rank {rank}: {type(e).__name__}: {e}"


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it 'assumes a single process' when no_dist=True: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_state(sd: dict, path: str, no_dist: bool = True, local: dict[str, str] | None = None) -> None:
    """DCP-load the checkpoint at `path` into the tensors of `sd` (resharding as needed), unpickling
    nothing but plain data; `local`: verified local copies of remote files (see `commit.verify`). A
    refused item raises UnsafeCheckpointError, other failures CheckpointError."""
    try:
        with quiet_single_process():
            dcp.load(sd, storage_reader=reader(path, local), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        for cause in (f[0] if isinstance(f, tuple) else f for f in e.failures.values()):
            if isinstance(cause, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(cause)) from None
        raise CheckpointError(f"loading {path} failed: {describe_error(e, 0)}") from None
