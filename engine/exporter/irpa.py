"""An IREE parameter archive (.irpa) written one tensor at a time, in any order.

IREE's own writer (iree.runtime.ParameterIndex.create_archive_file, behind turbine's save_module_parameters)
takes every tensor as a buffer in memory before it writes any, so a build would hold the whole model at once.
The format (iree/schemas/parameter_archive.h, version 0) is a header, an entry table and a metadata segment
whose sizes depend only on the names, lengths and metadata: this writer lays them out first, sizes the file,
and then puts each tensor's bytes where its entry says as soon as it is made. The layout is the one IREE's
builder picks (the same alignments and order), so the file is byte for byte what save_module_parameters
would write for the same tensors; tests/test_streamed_weights.py checks that.

Torch-free: entries are (name, byte length, metadata) and data any buffer.
"""
from __future__ import annotations

import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

MAGIC = 0x41505249  # "IRPA"
HEADER = struct.Struct("<IHHQQQ" "Q" "QQ" "QQ" "QQ")  # prefix, entry count, entry/metadata/storage segments
DATA_ENTRY = struct.Struct("<QIQ" "QQ" "QQ" "Q" "QQ")  # size, type, flags, name, metadata, alignment, storage
ENTRY_TYPE_DATA = 2
HEADER_ALIGNMENT = 16
ENTRY_ALIGNMENT = 16
DATA_ALIGNMENT = 64
FILE_ALIGNMENT = 4096


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Entry:
    name: str
    length: int  # bytes
    metadata: bytes = b""


class ArchiveWriter:
    """`ArchiveWriter(path, entries)` writes the header and sizes the file; `write(name, data)` once per entry,
    in any order; `close()` checks that every entry was written. Padding is never written: the file is sized
    up front, so the gaps read as zeros, as IREE's writer leaves them.

    The entries' bytes go to the file from a thread of the writer's own, so that the next tensor is made while
    the last is written (pwrite releases the GIL): an 8B's 4.8 GB took 4-13 s of pwrite on this host's disk, in
    series with the conversion before. `write` returns once the bytes are queued, and holds a reference to
    them until they are on their way; at most WRITES_QUEUED wait, which bounds the memory the overlap costs. A
    failed write is raised by the next `write` or by `close`."""

    WRITES_QUEUED = 2

    def __init__(self, path: Path, entries: list[Entry]) -> None:
        self.path = Path(path)
        self._offsets: dict[str, tuple[int, int]] = {}  # name -> (absolute offset, length)
        entry_start = _align(HEADER.size, HEADER_ALIGNMENT)
        entry_length = max(0, (len(entries) - 1) * _align(DATA_ENTRY.size, ENTRY_ALIGNMENT) + DATA_ENTRY.size)
        metadata_start = entry_start + entry_length
        table, metadata, storage = bytearray(), bytearray(), 0
        refs = []
        for e in entries:
            if e.name in self._offsets:
                raise ValueError(f"parameter {e.name} appears twice")
            name = e.name.encode()
            name_ref = (len(metadata), len(name))
            metadata += name
            meta_ref = (len(metadata), len(e.metadata))
            metadata += e.metadata
            storage = _align(storage, DATA_ALIGNMENT)
            refs.append((name_ref, meta_ref, (storage, e.length)))
            self._offsets[e.name] = (storage, e.length)  # relative until storage_start is known
            storage += e.length
        storage_start = _align(metadata_start + len(metadata), DATA_ALIGNMENT)
        for i, (name_ref, meta_ref, storage_ref) in enumerate(refs):
            table += DATA_ENTRY.pack(DATA_ENTRY.size, ENTRY_TYPE_DATA, 0, *name_ref, *meta_ref, DATA_ALIGNMENT,
                                     *storage_ref)
            if i + 1 < len(refs):
                table += bytes(_align(len(table), ENTRY_ALIGNMENT) - len(table))
        self._offsets = {k: (storage_start + off, n) for k, (off, n) in self._offsets.items()}
        header = HEADER.pack(MAGIC, 0, 0, HEADER.size, 0, 0, len(entries), entry_start, entry_length,
                             metadata_start, len(metadata), storage_start, storage)
        self._written: set[str] = set()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self._fd, _align(storage_start + storage, FILE_ALIGNMENT))
            self._pwrite(header, 0)
            self._pwrite(bytes(table), entry_start)
            self._pwrite(bytes(metadata), metadata_start)
        except BaseException:
            os.close(self._fd)
            raise
        self._queue: queue.Queue = queue.Queue(self.WRITES_QUEUED)
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._write_queued, name="irpa-writer", daemon=True)
        self._thread.start()

    def write(self, name: str, data) -> None:
        """Puts one entry's bytes (a buffer of exactly its length) in place."""
        if self._fd < 0:
            raise ValueError(f"{self.path.name} is closed")
        offset, length = self._offsets[name]
        view = memoryview(data).cast("B")
        if view.nbytes != length:
            raise ValueError(f"parameter {name}: {view.nbytes} bytes, but its entry holds {length}")
        if name in self._written:
            raise ValueError(f"parameter {name} written twice")
        self._raise_failed()
        self._queue.put((view, offset))
        self._written.add(name)

    def close(self) -> None:
        """Waits for the queued writes, then checks that every entry was written."""
        if self._fd < 0:
            return
        try:
            self._drain()
            self._raise_failed()
            missing = [name for name in self._offsets if name not in self._written]
            if missing:
                raise ValueError(f"{len(missing)} parameter(s) never written, e.g. {', '.join(missing[:3])}")
        finally:
            os.close(self._fd)
            self._fd = -1

    def _write_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self._failed is None:  # after a failure the rest are dropped: the file is abandoned anyway
                    self._pwrite(*item)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self._failed = exc
            del item

    def _drain(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise OSError(f"cannot write {self.path}: {self._failed}") from self._failed

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data)
        while view.nbytes:  # a single pwrite may write less than asked (Linux caps it near 2 GB)
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def __enter__(self) -> "ArchiveWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self._fd >= 0:
            self._drain()
            os.close(self._fd)
            self._fd = -1
