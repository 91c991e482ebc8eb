"""Where checkpoint bytes live: DCP storage readers/writers for local paths and fsspec URLs, file
checksums, and a metadata reader that cannot run code.

DCP's own readers unpickle `.metadata` with plain `pickle.load`, so a crafted checkpoint could run
arbitrary code on load. The readers here unpickle it with an allow-list of the handful of
classes DCP metadata is made of; anything else is refused.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_CHUNK = 8 << 20


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint's metadata references code outside the allow-list."""


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url)


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def sha256_file(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb", block_size=_CHUNK) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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


class _SafeMetadataMixin:
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadataMixin, dcp.FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    pass


def writer(url: str):
    return FsspecWriter(url) if is_remote(url) else dcp.FileSystemWriter(url.removeprefix("file://"))


def reader(url: str):
    return SafeFsspecReader(url) if is_remote(url) else SafeFileSystemReader(url.removeprefix("file://"))
