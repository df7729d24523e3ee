"""Where the bytes of batch files live: one small interface, two implementations behind it.

- :class:`LocalFiles`, a directory under ``state_dir`` (a lone gateway): files are written whole to a temporary name,
  flushed to disk and renamed, so a file that exists is complete (a SIGKILL mid-upload leaves only a temporary).
- :class:`DatabaseFiles`, rows of ``batch_file_chunks`` in the batch database (replicas sharing one PostgreSQL,
  ``gateway.replicas.shared``): a file uploaded through one replica is read by the one that runs its batch, and its
  output downloaded through any. A file is written in one transaction, so it exists whole or not at all.

An object store is a later option: it would implement the same three calls.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, cast

from sqlalchemy import Engine, delete, insert, select

from gateway.tenants.batch_schema import batch_file_chunks as chunks

CHUNK = 1024 * 1024


class FileStorage(Protocol):
    """The bytes of a file by id: written once (a rewrite of the same id replaces it), read (whole or line by line),
    deleted. ``open`` of a file that does not exist raises :class:`FileNotFoundError`."""

    def write(self, file_id: str, source: BinaryIO | bytes) -> int: ...
    def open(self, file_id: str) -> BinaryIO: ...
    def delete(self, file_id: str) -> None: ...


class LocalFiles:
    """Files as ``<root>/<id>.jsonl`` (mode 0600, the directory 0700: they hold tenants' prompts and answers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / f"{file_id}.jsonl"

    def write(self, file_id: str, source: BinaryIO | bytes) -> int:
        """Write ``source`` as ``file_id``; its size in bytes."""
        final = self.path(file_id)
        temporary = final.with_name(f".{final.name}.{secrets.token_hex(4)}.part")
        size = 0
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in _chunks(source):
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, final)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return size

    def open(self, file_id: str) -> BinaryIO:
        return open(self.path(file_id), "rb")

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


class DatabaseFiles:
    """Files as ``batch_file_chunks`` rows of at most :data:`CHUNK` bytes, in the database ``engine()`` returns (the
    batch store's, open by the time a file is used: the API and the runner open it first)."""

    def __init__(self, engine: Callable[[], Engine]) -> None:
        self.engine = engine

    def write(self, file_id: str, source: BinaryIO | bytes) -> int:
        """Write ``source`` as ``file_id`` (replacing a file of that id) in one transaction; its size in bytes."""
        size = 0
        with self.engine().begin() as conn:
            conn.execute(delete(chunks).where(chunks.c.file_id == file_id))
            for seq, chunk in enumerate(_chunks(source)):
                conn.execute(insert(chunks).values(file_id=file_id, seq=seq, data=bytes(chunk)))
                size += len(chunk)
            if size == 0:
                conn.execute(insert(chunks).values(file_id=file_id, seq=0, data=b""))  # an empty file exists too
        return size

    def open(self, file_id: str) -> BinaryIO:
        """A reader that fetches one chunk at a time (a file is never held whole in memory)."""
        engine = self.engine()
        with engine.begin() as conn:
            if conn.execute(select(chunks.c.seq).where(chunks.c.file_id == file_id, chunks.c.seq == 0)).first() is None:
                raise FileNotFoundError(f"no batch file {file_id} in the database")
        return cast(BinaryIO, io.BufferedReader(_ChunkReader(engine, file_id), buffer_size=CHUNK))

    def delete(self, file_id: str) -> None:
        with self.engine().begin() as conn:
            conn.execute(delete(chunks).where(chunks.c.file_id == file_id))


class _ChunkReader(io.RawIOBase):
    """The chunks of one file, in order, each read in a transaction of its own when the previous one is used up."""

    def __init__(self, engine: Engine, file_id: str) -> None:
        self._engine, self._file_id = engine, file_id
        self._seq = 0
        self._chunk = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._chunk:
            query = select(chunks.c.data).where(chunks.c.file_id == self._file_id, chunks.c.seq == self._seq)
            with self._engine.begin() as conn:
                data = conn.execute(query).scalar()
            if data is None:
                return 0  # the end of the file
            self._chunk, self._seq = memoryview(bytes(data)), self._seq + 1
        count = min(len(buffer), len(self._chunk))
        buffer[:count] = self._chunk[:count]
        self._chunk = self._chunk[count:]
        return count


def _chunks(source: BinaryIO | bytes) -> Iterator[bytes]:
    if isinstance(source, bytes):
        for start in range(0, len(source), CHUNK):
            yield source[start : start + CHUNK]
        return
    while chunk := source.read(CHUNK):
        yield chunk


class LinesReader(io.RawIOBase):
    """A readable stream of the byte strings ``lines`` yields, made as they are read (a file written as it is checked)."""

    def __init__(self, lines: Iterator[bytes]) -> None:
        self._lines = lines
        self._left = b""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        parts, count = [self._left], len(self._left)
        while size < 0 or count < size:
            line = next(self._lines, None)
            if line is None:
                break
            parts.append(line)
            count += len(line)
        data = b"".join(parts)
        cut = len(data) if size < 0 else size
        self._left = data[cut:]
        return data[:cut]


def jsonl_lines(stream: BinaryIO) -> Iterator[tuple[int, int, bytes]]:
    """(index, number, line) of each non-blank line: the index counts non-blank lines from 0 (how batch lines are
    numbered at validation and at run time alike), the number is the line's own in the file, from 1 (what errors name)."""
    index = 0
    for number, raw in enumerate(stream, start=1):
        line = raw.strip()
        if line:
            yield index, number, line
            index += 1
