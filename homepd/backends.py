"""Which model implementation a process uses: llama.cpp (``homepd.llm``) or the fake (``homepd.fakellm``)."""
from __future__ import annotations


def model_classes(backend: str):
    """(model class, context class) for ``backend`` ("llama" or "fake"); imported only when asked for."""
    if backend == "fake":
        from homepd.fakellm import FakeContext, FakeModel  # why: numpy, for the fake only

        return FakeModel, FakeContext
    from homepd.llm import LlamaContext, LlamaModel  # why: llama_cpp, for the llama backend only

    return LlamaModel, LlamaContext
