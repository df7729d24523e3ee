"""How every process of the gateway writes its log: one format, so the control process's lines and its
workers' lines read as one stream (each request's line names its worker)."""

from __future__ import annotations

import sys

from loguru import logger


def configure_logging(verbose: bool) -> None:
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if verbose else "INFO", format="{time:HH:mm:ss} | {level: <7} | {message}")
