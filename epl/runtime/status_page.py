"""A worker's last known record in shared memory, readable by the workers on its host.

A worker that is stopped (SIGSTOP, a debugger), frozen, or killed cannot answer
its status server (epl.runtime.worker_status). So that the others can still
say what it was last doing, every worker keeps its record in a small
memory-mapped file, ``epl-worker-<pid>.status`` in ``/dev/shm`` (else the
temporary directory), rewritten at each phase change (a session run starts
or ends) and marked in place for each collective it submits. Writing it is a
memory copy, no system call. Another process on the same host reads it by the
worker's process id (exchanged by the collective check).

Layout: an 8-byte sequence number (odd while a write is under way, so a
reader retries instead of reading half a record), a 4-byte length, the
record as JSON, then one byte per collective of the current run (1 once
submitted, in the order of the record's ``collectives``).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile

PAGE_BYTES = 1 << 16
_HEADER = struct.Struct("<QI")
_FLAGS_BYTES = 4096  # one byte per collective of the run, at the end of the page
_RECORD_BYTES = PAGE_BYTES - _HEADER.size - _FLAGS_BYTES
_FLAGS_AT = PAGE_BYTES - _FLAGS_BYTES


def page_dir() -> str:
    """Where the pages live: /dev/shm when it is a writable directory, else the temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def page_path(pid: int, directory: str | None = None) -> str:
    """The page of process `pid`."""
    return os.path.join(directory or page_dir(), "epl-worker-%d.status" % pid)


class StatusPage:
    """This process's page (write side)."""

    def __init__(self, directory: str | None = None):
        self.path = page_path(os.getpid(), directory)
        _remove_stale(os.path.dirname(self.path))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, PAGE_BYTES)
            self._map = mmap.mmap(fd, PAGE_BYTES)
        finally:
            os.close(fd)
        self._seq = 0
        self._names: list[str] | None = None
        self._names_json = b"[]"
        self._index: dict[str, int] = {}

    def write(self, record: dict, collectives: list[str]) -> None:
        """Replace the record (it has no "collectives"); `collectives`: the current
        run's, none submitted yet (their JSON is kept while they stay the same)."""
        if collectives is not self._names and collectives != self._names:
            self._names = collectives
            self._names_json = json.dumps(self._names[:_FLAGS_BYTES],
                                          separators=(",", ":")).encode()
            self._index = {name: i for i, name in enumerate(self._names[:_FLAGS_BYTES])}
        head = json.dumps(record, separators=(",", ":")).encode()
        data = head[:-1] + b',"collectives":' + self._names_json + b"}"
        if len(data) > _RECORD_BYTES:  # a run with very many collectives: keep the record
            data = head
        self._seq += 1  # odd: being written
        self._map[0:8] = struct.pack("<Q", self._seq)
        self._map[_HEADER.size:_HEADER.size + len(data)] = data
        self._map[8:12] = struct.pack("<I", len(data))
        used = min(len(self._names), _FLAGS_BYTES)
        self._map[_FLAGS_AT:_FLAGS_AT + used] = bytes(used)
        self._seq += 1
        self._map[0:8] = struct.pack("<Q", self._seq)

    def mark(self, name: str) -> None:
        """Collective `name` of the current run was submitted."""
        index = self._index.get(name)
        if index is not None:
            self._map[_FLAGS_AT + index] = 1

    def close(self) -> None:
        """Remove the page (at exit)."""
        try:
            self._map.close()
            os.unlink(self.path)
        except (OSError, ValueError):
            pass


def read_page(pid: int, directory: str | None = None) -> dict | None:
    """The last record process `pid` wrote, with ``submitted`` filled in from its
    marks; None when there is no readable page."""
    try:
        with open(page_path(pid, directory), "rb") as f:
            for _ in range(5):
                raw = f.read(PAGE_BYTES)
                f.seek(0)
                if len(raw) < PAGE_BYTES:
                    return None
                seq, length = _HEADER.unpack_from(raw)
                again = struct.unpack_from("<Q", f.read(8))[0]
                f.seek(0)
                if seq % 2 == 0 and seq == again and 0 < length <= _RECORD_BYTES:
                    record = json.loads(raw[_HEADER.size:_HEADER.size + length])
                    flags = raw[_FLAGS_AT:]
                    names = record.get("collectives") or []
                    record["submitted"] = [n for i, n in enumerate(names) if flags[i]]
                    return record
    except (OSError, ValueError):
        return None
    return None


def _remove_stale(directory: str) -> None:
    """Remove the pages of processes that no longer exist (a killed worker leaves its page)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith("epl-worker-") and name.endswith(".status")):
            continue
        try:
            pid = int(name[len("epl-worker-"):-len(".status")])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except PermissionError:  # another user's live process
            continue
