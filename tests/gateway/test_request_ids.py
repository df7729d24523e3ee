"""Request ids the gateway makes up (a request without a usable ``X-Request-Id``): random, drawn many at a time."""

from __future__ import annotations

import os
import re

from gateway.core.context import new_request_id


def test_request_ids_are_32_hex_digits_and_do_not_repeat() -> None:
    ids = [new_request_id() for _ in range(2000)]  # several draws from the OS
    assert all(re.fullmatch(r"[0-9a-f]{32}", one) for one in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_draws_ids_of_its_own() -> None:
    new_request_id()  # the parent holds a draw with ids left in it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{32}", child)
    assert child != new_request_id()  # the parent's next one: the child did not take it from the parent's draw
