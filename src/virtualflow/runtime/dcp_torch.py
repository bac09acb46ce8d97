"""The parts of :mod:`virtualflow.runtime.dcp` built on ``torch.distributed.checkpoint``.

Kept apart so that importing the runtime (every worker process does) does not import
``torch.distributed.checkpoint`` (about 0.7 CPU-seconds per process, measured): only a worker
that writes or reads a sharded checkpoint pays for it (:func:`virtualflow.runtime.dcp_read.torch_dcp`).
"""

from __future__ import annotations

import io
import math
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp  # noqa: F401 - save/load, used by runtime/dcp.py
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
# private: what DCP's reader looks files up by (checked on torch 2.13)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from virtualflow.runtime.checkpoint import UntrustedStateError

class PiecePlanner(DefaultSavePlanner):
    """Writes each piece as one DCP chunk at its global offset (no process group needed)."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {p.fqn: p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.pieces.values():
            t = p.tensor
            items.append(WriteItem(
                index=MetadataIndex(p.fqn, torch.Size([p.lo])), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([p.lo]), torch.Size([t.numel()])),
                                            properties=TensorProperties.create_from_tensor(t),
                                            size=torch.Size([math.prod(p.shape)]))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.pieces[index.fqn].tensor


def metadata_of(entries: list[dict[str, Any]], dtypes: dict[str, torch.dtype]) -> Metadata:
    md: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for e in entries:
        n = math.prod(e["shape"])
        tmd = md.setdefault(e["fqn"], TensorStorageMetadata(TensorProperties(dtype=dtypes[e["dtype"]]),
                                                            torch.Size([n]), []))
        tmd.chunks.append(ChunkStorageMetadata(torch.Size([e["lo"]]), torch.Size([e["hi"] - e["lo"]])))
        storage[MetadataIndex(e["fqn"], torch.Size([e["lo"]]))] = _StorageInfo(e["file"], e["offset"], e["length"])
    return Metadata(state_dict_metadata=md, storage_data=storage)


class _MemberFileSystem(FileSystem):
    """DCP's file access, with every shard opened by ``opener(folder, relative name)``
    (``virtualflow.runtime.dcp_read._open_member``: no link followed, a FIFO refused without
    blocking), so that a file swapped after the digests were checked cannot hang or redirect
    the read."""

    def __init__(self, folder: str, opener: Callable[[str, str], int]) -> None:
        super().__init__()
        self._folder, self._opener = folder, opener

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise ValueError(f"a checkpoint being read is not written ({path}, mode {mode!r})")
        name = os.path.relpath(os.fspath(path), self._folder).replace(os.sep, "/")
        with os.fdopen(self._opener(self._folder, name), "rb") as stream:
            yield stream


class ManifestReader(FileSystemReader):
    """DCP's file reader with its metadata built from the verified manifest (never unpickled)."""

    def __init__(self, folder: str, entries: list[dict[str, Any]], dtypes: dict[str, torch.dtype],
                 opener: Callable[[str, str], int] | None = None) -> None:
        super().__init__(folder)
        self._md = metadata_of(entries, dtypes)
        if opener is not None:
            self.fs = _MemberFileSystem(os.fspath(self.path), opener)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._md


class RangePlanner(DefaultLoadPlanner):
    """Reads elements ``[lo, hi)`` of each wanted flat entry, from whichever chunks hold them."""

    def __init__(self, ranges: dict[str, tuple[int, int]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.ranges = ranges

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for fqn, (lo, hi) in self.ranges.items():
            if hi > lo:
                chunk = ChunkStorageMetadata(torch.Size([lo]), torch.Size([hi - lo]))
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UntrustedStateError("a virtualflow checkpoint holds tensors only; refusing to unpickle an object")


