"""Seeded traces that look like chat and RAG traffic: prompts that share prefixes.

``chat`` — multi-turn conversations.  Conversations start on the arrival
process (``rate_per_s`` conversations per second); each has ``turns`` turns,
and every turn resends the whole history: a fixed system prompt (the same in
every conversation, as a chat front-end's is), the earlier questions, and the
earlier answers as synthetic text of their trace output length (the replay
uses ``ignore_eos``, so each answer the engine produced had that length too).
A later turn is sent a think time after the previous one ended (exponential,
mean ``think_s``); the trace keeps the conversation, the turn and the think
time so a replay can do so.

``rag`` — a RAG front-end: ``documents`` passages of about ``long_tokens``
tokens from the shipped corpus (each from a different document), several
questions about each; every prompt is the passage first, then the question, so
questions about one document share its passage as a prefix.  Questions arrive
open-loop on the arrival process, the documents' questions interleaved.

Prompts, output lengths, think times and arrivals draw from separate streams
of one seed, as in ``generate``.  What a trace file with conversations must
satisfy is the trace's own check (``model.check_conversations``);
``conversations`` groups a trace into the units the replay sends (a
conversation's turns, or one request).
"""
from __future__ import annotations

import math
import random

from homepd.errors import ConfigError
from homepd.measure.trace import corpus
from homepd.measure.trace.arrivals import arrival_offsets
from homepd.measure.trace.model import CHARS_PER_TOKEN, CLASS_OF_KIND, TraceRequest

CHAT_TURNS = 4                  # turns per conversation
# why 2 s: short enough for a benchmark of a few conversations (advise's chat mix); people take longer
CHAT_THINK_S = 2.0              # mean think time between an answer and the next question (--think-s)
RAG_DOCUMENTS = 2
SYSTEM_PROMPT = ("You are a helpful assistant on a home server. Answer clearly and briefly, and say so when you "
                 "are not sure.")
RAG_HEAD = ('Answer the question using only this passage from "{title}".\n\n')
RAG_QUESTIONS = (
    "What is the main point of this passage?",
    "List three facts the passage states.",
    "What would a beginner find hardest here, according to the passage?",
    "Summarise the passage in one sentence.",
    "Which advice in the passage is the most practical?",
    "What does the passage say about timing or seasons?",
    "Is there anything the passage warns against?",
    "Explain the passage to a ten-year-old.",
)


def make_chat(n_requests: int, rate_per_s: float, *, turns: int = CHAT_TURNS, think_s: float = CHAT_THINK_S,
              arrival: str = "poisson", burstiness: float = 1.0, output_tokens: tuple[int, int] = (32, 128),
              max_tokens: int | None = None, ignore_eos: bool = True, seed: int = 0) -> list[TraceRequest]:
    """``n_requests`` turns in conversations of ``turns`` (the last one shorter when they do not divide), in
    order of their earliest send time (``arrival_s``)."""
    if turns < 1:
        raise ConfigError(f"a conversation needs at least one turn, got {turns}")
    if not think_s >= 0 or not math.isfinite(think_s):
        raise ConfigError(f"think time must be a finite number >= 0 s, got {think_s}")
    n_conversations = math.ceil(n_requests / turns)
    starts = arrival_offsets(n_conversations, rate_per_s, random.Random(f"{seed}/arrivals"), arrival=arrival,
                             burstiness=burstiness)
    prompts, outputs = random.Random(f"{seed}/prompts"), random.Random(f"{seed}/outputs")
    thinks = random.Random(f"{seed}/think")
    questions = list(corpus.chat_questions())
    prompts.shuffle(questions)
    n_corpus = corpus.corpus_chars()
    requests, q = [], 0
    for c, start in enumerate(starts):
        history = ({"role": "system", "content": SYSTEM_PROMPT},)
        t, n_turns = start, min(turns, n_requests - c * turns)
        for k in range(n_turns):
            think = 0.0 if k == 0 else round(thinks.expovariate(1.0 / think_s), 3) if think_s else 0.0
            t += think
            history += ({"role": "user", "content": questions[q % len(questions)]},)
            q += 1
            n_out = max_tokens or outputs.randint(*output_tokens)
            requests.append(TraceRequest(arrival_s=round(t, 4), messages=history, max_tokens=n_out, kind="chat",
                                         request_class=CLASS_OF_KIND["chat"], ignore_eos=ignore_eos,
                                         conversation=c, turn=k, think_s=think))
            # why synthetic: a replay sends the trace's text, so every candidate sees the same prompt tokens
            answer = corpus.filler(prompts.randrange(n_corpus), round(n_out * CHARS_PER_TOKEN)).strip() or "ok"
            history += ({"role": "assistant", "content": answer},)
    return sorted(requests, key=lambda r: (r.arrival_s, r.conversation, r.turn))


def make_rag(n_requests: int, rate_per_s: float, *, documents: int = RAG_DOCUMENTS, long_tokens: int = 400,
             arrival: str = "poisson", burstiness: float = 1.0, output_tokens: tuple[int, int] = (32, 128),
             max_tokens: int | None = None, ignore_eos: bool = True, seed: int = 0) -> list[TraceRequest]:
    """``n_requests`` questions about ``documents`` passages, open loop."""
    docs = corpus.documents()
    if not 1 <= documents <= len(docs):
        raise ConfigError(f"documents must be between 1 and {len(docs)} (the shipped corpus), got {documents}")
    prompts, outputs = random.Random(f"{seed}/prompts"), random.Random(f"{seed}/outputs")
    chosen = prompts.sample(range(len(docs)), documents)
    passages = [corpus.passage_of(d, prompts.randrange(len(docs[d].paragraphs)),
                                  round(long_tokens * CHARS_PER_TOKEN), head=RAG_HEAD) for d in chosen]
    order = [i % documents for i in range(n_requests)]
    prompts.shuffle(order)
    asked = [prompts.sample(RAG_QUESTIONS, len(RAG_QUESTIONS)) for _ in range(documents)]
    offsets = arrival_offsets(n_requests, rate_per_s, random.Random(f"{seed}/arrivals"), arrival=arrival,
                              burstiness=burstiness)
    requests, n_asked = [], [0] * documents
    for t, d in zip(offsets, order):
        question = asked[d][n_asked[d] % len(RAG_QUESTIONS)]
        n_asked[d] += 1
        requests.append(TraceRequest(
            arrival_s=t, messages=({"role": "user", "content": f"{passages[d]}\n\nQuestion: {question}"},),
            max_tokens=max_tokens or outputs.randint(*output_tokens), kind="rag",
            request_class=CLASS_OF_KIND["rag"], ignore_eos=ignore_eos))
    return requests


def conversations(requests) -> list[list[int]]:
    """The replay units of ``requests``, by index in trace order of their first request: each conversation's turns
    in order, and every request outside a conversation alone."""
    units: dict[object, list[int]] = {}
    for i, r in enumerate(requests):
        conv = getattr(r, "conversation", None)
        units.setdefault(("c", conv) if conv is not None else ("r", i), []).append(i)
    return list(units.values())

