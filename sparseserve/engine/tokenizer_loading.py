"""The engine's tokenizer: the checkpoint's own, an explicit `tokenizer=`, or none (token-id prompts)."""
from __future__ import annotations

import logging
from pathlib import Path

from ..errors import CheckpointError

logger = logging.getLogger("sparseserve")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path, explicit: bool = False):
    """The tokenizer at `path`. A checkpoint without tokenizer files runs on token ids (logged); an
    explicit `tokenizer=` that does not load, or tokenizer files that do not load, are errors."""
    from transformers import AutoTokenizer

    has_files = path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES)
    if not explicit and not has_files:
        logger.info("no tokenizer files in %s; prompts must be token ids", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
        what = f"tokenizer={str(path)!r}" if explicit else f"the tokenizer files in {path}"
        raise CheckpointError(f"{what} could not be loaded ({type(exc).__name__}: {exc}); give a directory with a "
                              "valid tokenizer.json, or skip_tokenizer_init=True and token-id prompts") from exc
