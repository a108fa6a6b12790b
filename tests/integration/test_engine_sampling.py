"""Sampling and stop strings through the real engine."""
from __future__ import annotations

from homepd.config import EngineConfig
from homepd.core.sampling import SamplingParams
from homepd.llm import LlamaModel

from engine_helpers import N_THREADS, make_engine, PROMPTS, run


def test_seeded_sampling_repeats_and_stop_strings_cut_text(default_model_path):
    async def scenario():
        # why no prefix cache: the same seed repeats the same computation only; a second request served from
        # the first one's cached prompt computes its last prompt token alone, and llama.cpp is not batch-
        # invariant (without flash attention a step attends over a cell count that the cached cells change)
        # and no adaptive chunk: a prompt's slices then follow the fitted step time, which a loaded box changes
        cfg = EngineConfig(model=str(default_model_path), n_ctx=512, n_seq_max=4, chunk=64, n_threads=N_THREADS,
                           prefix_cache=False, adaptive_chunk=False)
        async with make_engine(cfg) as engine:
            async def text(params, prompt=PROMPTS[1]):
                events, out = await (await engine.submit(prompt, params=params)).collect()
                return events, out

            hot = dict(max_tokens=24, temperature=1.2, top_k=40, top_p=0.95, ignore_eos=True)
            a = await text(SamplingParams(seed=7, **hot))
            b = await text(SamplingParams(seed=7, **hot))
            c = await text(SamplingParams(seed=8, **hot))
            greedy = await text(SamplingParams(max_tokens=24, ignore_eos=True), PROMPTS[0])
            stop_word = greedy[1].split()[1]  # a word the greedy answer does contain
            cut = await text(SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop_word,)), PROMPTS[0])
            chat = await (await engine.submit(messages=[{"role": "user", "content": "Say hello."}],
                                              params=SamplingParams(max_tokens=40))).collect()
            return a, b, c, greedy, stop_word, cut, chat

    a, b, c, greedy, stop_word, cut, chat = run(scenario())
    assert a[1] == b[1] and a[1] != c[1]
    assert cut[0][-1].finish_reason == "stop"
    assert stop_word not in cut[1] and greedy[1].startswith(cut[1])
    assert greedy[1].index(stop_word) == len(cut[1])  # cut exactly before the stop string
    # the chat template was applied: an answer, not a continuation of raw template markup
    assert chat[0][-1].kind == "done" and chat[1].strip() and "<|im_" not in chat[1]


def test_ignore_eos_goes_on_as_text_without_an_end_of_generation_token(default_model_path):
    """A short answer ends with an end-of-generation token.  Under ``ignore_eos`` that token is banned, greedy
    or sampled, as llama-server bans it: the answer goes on to ``max_tokens`` as text.  (Sampled and stepped
    over, such tokens streamed as nothing, and a benchmark's client saw two or three steps as one gap.)"""
    hello = [{"role": "user", "content": "Say hello."}]

    async def scenario():
        # why one sequence and one thread: the three requests are then one computation up to the ban (the same
        # cells, the same reduction order); on 4 sequences and the worker's threads, the suite once saw the
        # greedy answers part at token 13 of 20 on a near-tie.  And a fixed chunk: the adaptive one slices the
        # prompt by the fitted step time, which the suite's load changes between requests (it parted there again,
        # at token 13, with one sequence and one thread)
        cfg = EngineConfig(model=str(default_model_path), n_ctx=512, n_seq_max=1, chunk=64, n_threads=1,
                           prefix_cache=False, prefill_seqs=0, adaptive_chunk=False)  # each computed alone, alike
        async with make_engine(cfg) as engine:
            async def tokens(params):
                stream = await engine.submit(messages=hello, params=params)
                events, _ = await stream.collect()
                return events[-1].finish_reason, list(stream.token_ids)

            return (await tokens(SamplingParams(max_tokens=40)),
                    await tokens(SamplingParams(max_tokens=40, ignore_eos=True)),
                    await tokens(SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, top_p=0.9, seed=5)))

    (free_end, free), (greedy_end, greedy), (sampled_end, sampled) = run(scenario())
    model = LlamaModel(default_model_path, vocab_only=True)
    try:
        eog = set(model.eog_ids.tolist())
        texts = [model.detokenize(ids) for ids in (greedy, sampled)]
    finally:
        model.close()
    assert free_end == "stop" and len(free) < 40  # it ends by itself: where the ban has something to do
    n_text = len([t for t in free if t not in eog])
    for end, ids in ((greedy_end, greedy), (sampled_end, sampled)):
        assert end == "length" and len(ids) == 40 and not eog & set(ids)
    assert greedy[:n_text] == free[:n_text]  # the same answer up to where it would have ended
    assert all(text.strip() for text in texts)
