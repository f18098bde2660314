"""The package logger; SPARSESERVE_LOGGING_LEVEL (default INFO) sets its level."""
from __future__ import annotations

import logging

from . import envs

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def init_logger() -> logging.Logger:
    logger = logging.getLogger("sparseserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    level = envs.logging_level()
    logger.setLevel(getattr(logging, level, logging.INFO))
    return logger
