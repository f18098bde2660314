"""Helpers for tests that start the OpenAI-compatible server on a free localhost port."""
from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.entrypoints.openai.api_server import ServerThread, build_app

V4_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(llm_engine, names=("tiny",), api_key=None, max_waiting_requests=None):
    """(base_url, AsyncLLMEngine); the HTTP thread and the engine loop are stopped on exit."""
    engine = AsyncLLMEngine(llm_engine, max_waiting_requests=max_waiting_requests)
    engine.start()
    port = free_port()
    server = ServerThread(build_app(engine, list(names), api_key), "127.0.0.1", port)
    try:
        server.start()
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.stop()
        engine.shutdown()


def write_v4_tokenizer(directory: Path, vocab_size: int = 512) -> Path:
    """A character-level tokenizer with DeepSeek-V4's role tokens (and no chat template), so the
    server renders DeepSeek-V4's chat format; the think and DSML markers are plain characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n", "｜", "▁"]
    vocab = {t: i for i, t in enumerate(V4_SPECIALS + chars)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<f{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.add_special_tokens(V4_SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": V4_SPECIALS[0], "eos_token": V4_SPECIALS[1]}))
    return directory
