"""The channel between the control process and its workers: pickled messages, length-prefixed, over a Unix socket.

Both ends are this program, started by the same user: the socket lives in a directory only that user can
enter (0700), so what crosses it (settings, upstream keys) stays as private as the process memory it came from.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

_LENGTH = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # a state with thousands of models stays far below this


def write(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue ``message`` on ``writer`` without waiting (the transport buffers it)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(data)) + data)


async def send(writer: asyncio.StreamWriter, message: Any) -> None:
    write(writer, message)
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> Any:
    """The next message; ``asyncio.IncompleteReadError`` when the other end closed."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_MESSAGE:
        raise ConnectionError(f"message of {length} bytes on the worker channel")
    return pickle.loads(await reader.readexactly(length))


def send_blocking(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive_blocking(sock: socket.socket) -> Any:
    (length,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
    if length > MAX_MESSAGE:
        raise ConnectionError(f"message of {length} bytes on the worker channel")
    return pickle.loads(_read_exactly(sock, length))


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the control process closed the worker channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
