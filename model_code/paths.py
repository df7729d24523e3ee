"""Where the code a logged model packs lives: this package, and the folder that holds it and ``launch/``
(a checkout, or site-packages)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
