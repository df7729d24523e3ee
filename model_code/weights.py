"""The weights folder a logged model packs, made packable when it links out of itself.

MLflow refuses an artifact file that is a symbolic link resolving outside the artifact's folder ("resolved path is
outside the artifact directory"), and that is exactly how a Hugging Face cache snapshot is laid out
(``snapshots/<revision>/config.json -> ../../blobs/<sha>``). Such a folder is packed through a mirror of it whose
files are hard links to what the links point at: no bytes copied where the mirror can sit on the same filesystem
(beside the folder), a copy elsewhere. The mirror keeps the folder's name, which is the name the served model
loads it under, and is removed once the model is logged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

_MIRROR_PREFIX = ".sglang-gateway-pack-"


def links_out_of(folder: Path) -> list[Path]:
    """The symbolic links under ``folder`` that resolve outside it (a linked folder counts as one; links are not
    followed, so a link back into the folder cannot loop the walk)."""
    root = folder.resolve()
    escaping = []
    for parent, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            path = Path(parent, name)
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                escaping.append(path)
    return escaping


def _link_or_copy(source: str, target: str) -> None:
    """Hard-link what ``source`` points at, or copy it across filesystems. (Linux's link(2), which ``os.link`` calls
    by default, links a symbolic link itself, which would leave a dangling relative link: hence realpath.)"""
    try:
        os.link(os.path.realpath(source), target)
    except OSError:
        shutil.copy2(source, target)


@contextlib.contextmanager
def packable(weights: Path) -> Iterator[Path]:
    """``weights`` itself when MLflow can pack it, else a mirror of it (see the module docstring) for the
    duration of the ``with`` block."""
    if not links_out_of(weights):
        yield weights
        return
    with contextlib.ExitStack() as stack:
        try:  # beside the folder: same filesystem as a Hugging Face cache's blobs, so hard links, no copy
            holder = stack.enter_context(tempfile.TemporaryDirectory(prefix=_MIRROR_PREFIX, dir=weights.parent))
        except OSError:
            holder = stack.enter_context(tempfile.TemporaryDirectory(prefix=_MIRROR_PREFIX))
        mirror = Path(holder, weights.name)
        shutil.copytree(weights, mirror, symlinks=False, copy_function=_link_or_copy)
        yield mirror
