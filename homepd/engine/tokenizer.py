"""A model's chat template and tokenizer without an engine: its vocabulary only, loaded in milliseconds.

What-if and live advice (``homepd.advise``) simulate traces in the twin, whose prefix cache must find what the
real one finds: they tokenize each prompt exactly as ``Engine.prepare`` does (``request_tokens``), here.
"""
from __future__ import annotations

from homepd.backends import model_classes
from homepd.config import EngineConfig, kv_streams, request_n_ctx
from homepd.engine.prompt import request_tokens


class PromptTokenizer:
    """``tokenizer(request)`` -> the prompt ids ``Engine.prepare`` would give a trace request on ``config``."""

    def __init__(self, config: EngineConfig, model_path: str):
        self.config = config
        self.model = model_classes(config.backend)[0](model_path, 0, True)

    def __call__(self, request) -> list[int]:
        messages = list(request.messages) if request.messages is not None else None
        return request_tokens(self.model, request_n_ctx(self.config), request.prompt, messages,
                              streams=kv_streams(self.config))

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> "PromptTokenizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
