"""Which model implementation a process uses: llama.cpp (``homepd.llm``) or the fake (``homepd.fakellm``), for
chat and for embeddings."""
from __future__ import annotations


def model_classes(backend: str):
    """(model class, context class) for ``backend`` ("llama" or "fake"); imported only when asked for."""
    if backend == "fake":
        from homepd.fakellm import FakeContext, FakeModel  # why: numpy, for the fake only

        return FakeModel, FakeContext
    from homepd.llm import LlamaContext, LlamaModel  # why: llama_cpp, for the llama backend only

    return LlamaModel, LlamaContext


def embedder_class(backend: str):
    """The embedding model class for ``backend``: ``homepd.llm.embed.LlamaEmbedder`` or the fake's."""
    if backend == "fake":
        from homepd.fakellm import FakeEmbedder  # why: numpy, for the fake only

        return FakeEmbedder
    from homepd.llm.embed import LlamaEmbedder  # why: llama_cpp, for the llama backend only

    return LlamaEmbedder
