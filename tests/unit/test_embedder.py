"""The service's embedding model (``homepd.engine.embedder``) on the fake backend: one load for many concurrent
requests, every request answered in turn, the queue bounded, the keep-alive's unload, and the context's cut."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from homepd.engine.embedder import EmbeddingModel, EmbedQueueFull, ModelState
from homepd.errors import RequestError


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_share_one_load_and_are_all_answered():
    async def main():
        model = EmbeddingModel("fake://embedding", backend="fake", keep_alive_s=None)
        results = await asyncio.gather(*(model.embed([f"text {i}", "the same"], truncate=True) for i in range(12)))
        await model.close()
        return model, results

    model, results = run(main())
    assert model.n_loads == 1 and len(results) == 12
    assert all(r.vectors.shape == (2, 384) for r in results)
    assert np.allclose(results[0].vectors[1], results[11].vectors[1])


def test_a_queue_past_its_bound_refuses_and_the_rest_are_answered():
    async def main():
        model = EmbeddingModel("fake://embedding", backend="fake", max_waiting=3)
        outcomes = await asyncio.gather(*(model.embed(["x"], truncate=True) for _ in range(5)),
                                        return_exceptions=True)
        await model.close()
        return outcomes

    outcomes = run(main())
    assert [type(o).__name__ for o in outcomes].count("Embeddings") == 3
    assert all(isinstance(o, EmbedQueueFull) for o in outcomes[3:])


def test_keep_alive_unloads_when_it_runs_out_and_zero_unloads_at_once():
    async def main():
        model = EmbeddingModel("fake://embedding", backend="fake", keep_alive_s=0.05)
        await model.embed(["x"], truncate=True)
        assert model.state is ModelState.LOADED and model.expires_at_unix_s is not None
        await asyncio.sleep(0.2)
        assert model.state is ModelState.UNLOADED
        await model.embed(["x"], truncate=True, keep_alive_s=None)
        assert model.state is ModelState.LOADED and model.expires_at_unix_s is None
        await asyncio.sleep(0.1)
        assert model.state is ModelState.LOADED and model.n_loads == 2
        await model.embed(["x"], truncate=True, keep_alive_s=0)
        await asyncio.sleep(0.01)
        assert model.state is ModelState.UNLOADED
        await model.close()

    run(main())


def test_an_input_over_the_context_is_cut_when_asked_and_refused_otherwise():
    async def main():
        model = EmbeddingModel("fake://embedding", backend="fake")
        cut = await model.embed(["word " * 600], truncate=True)
        with pytest.raises(RequestError, match=r"input\[1\] is 602 tokens; the embedding model's context is 512"):
            await model.embed(["short", "word " * 600], truncate=False)
        await model.close()
        return cut

    cut = run(main())
    assert cut.n_tokens == (512,) and cut.n_truncated == 1
