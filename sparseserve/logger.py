"""The package logger; SPARSESERVE_LOGGING_LEVEL (default INFO) sets its level."""
from __future__ import annotations

import logging
import sys

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


def show_progress() -> bool:
    """Whether long work draws a progress bar (tqdm, on stderr): stderr is a terminal, the package
    logs at INFO or below, and this process is rank 0 of a parallel layout (as vLLM's loader)."""
    # The package logger's level once set (init_logger), else SPARSESERVE_LOGGING_LEVEL's (a bench client).
    level = logging.getLogger("sparseserve").level or getattr(logging, envs.logging_level(), logging.INFO)
    if not sys.stderr.isatty() or level > logging.INFO:
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def progress_bar(iterable=None, enabled: bool = True, **kwargs):
    """A tqdm bar on stderr, drawn when `enabled` and `show_progress()`; `kwargs` go to tqdm."""
    from tqdm import tqdm

    return tqdm(iterable, disable=not (enabled and show_progress()), dynamic_ncols=True, file=sys.stderr, **kwargs)
