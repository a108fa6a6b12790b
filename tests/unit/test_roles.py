"""Worker roles on the fake backend: a prefill worker exports KV into a real shared-memory KV arena
and a decode worker imports it and continues, in this process (no llama.cpp, no child processes)."""
from __future__ import annotations

import pickle

import pytest

from homepd.core.protocol import (AttachExtents, CancelRequest, KVHandoff, KVImported, RequestDone, StepReport,
                                  SubmitRequest, WorkerSpec)
from homepd.core.sampling import SamplingParams
from homepd.core.scheduler import Scheduler
from homepd.core.sequence import Sequence
from homepd.chat.textstream import TextStream
from homepd.fakellm import FakeContext, FakeModel
from homepd.kv.pool import KVArena
from homepd.worker.handoff import DecodeRole, PrefillRole
from homepd.worker.loop import WorkerLoop
from homepd.worker.roles import ColocatedRole

from worker_fakes import Outbox

FINGERPRINT = "f" * 64
N_CTX = 512


class Worker:
    """One in-process worker loop of ``role`` on the fake backend, with its outbox."""

    def __init__(self, role: str, n_seq_max: int = 4, n_ctx: int = N_CTX):
        self.spec = WorkerSpec(role=role, model_path="fake", n_ctx=n_ctx, n_seq_max=n_seq_max, chunk=32,
                               n_threads=1, model_fingerprint=FINGERPRINT, backend="fake")
        self.model = FakeModel()
        self.ctx = FakeContext(self.model, n_ctx=n_ctx, n_batch=self.spec.n_batch, n_seq_max=n_seq_max,
                               n_threads=1)
        self.out = Outbox()
        self.loop = WorkerLoop(self.spec, self.model, self.ctx, self.out)

    def turn(self) -> None:
        """One pass of the loop's body: the role's pump, then a step if there is one."""
        self.loop.role.pump()
        plan = self.loop.scheduler.schedule()
        if not plan.is_empty:
            self.loop.step(plan)

    def tokens_of(self, request_id: str) -> list[int]:
        return [t.token_id for r in self.out.of_type(StepReport) for t in r.tokens if t.request_id == request_id]

    def close(self) -> None:
        if getattr(self.loop.role, "pool", None) is not None:
            self.loop.role.pool.close()
        self.out.close()


@pytest.fixture
def pool():
    with KVArena.create(64 * 1024) as arena:
        yield arena


def submit(worker: Worker, request_id: str, text: str, max_tokens: int = 10) -> None:
    worker.loop.handle(SubmitRequest(request_id, tuple(worker.model.tokenize(text)),
                                     SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def colocated_tokens(text: str, max_tokens: int = 10) -> list[int]:
    worker = Worker("colocated")
    submit(worker, "r", text, max_tokens)
    while worker.loop.scheduler.has_work:
        worker.turn()
    worker.close()
    return worker.tokens_of("r")


def test_make_role_gives_each_worker_its_role():
    for role, cls in [("colocated", ColocatedRole), ("prefill", PrefillRole), ("decode", DecodeRole)]:
        worker = Worker(role)
        assert type(worker.loop.role) is cls
        worker.close()


def test_prefill_exports_into_an_extent_and_decode_continues_exactly_as_colocated(pool):
    prefill, decode = Worker("prefill"), Worker("decode")
    for w in (prefill, decode):
        w.loop.handle(AttachExtents(pool.names))
    submit(prefill, "r", "a prompt longer than one chunk of thirty-two tokens")
    while not prefill.out.of_type(KVHandoff):
        prefill.turn()
    (handoff,) = prefill.out.of_type(KVHandoff)
    assert not prefill.loop.scheduler.has_work and not prefill.ctx._seqs  # it left the prefill worker
    assert pool.state(handoff.offset).name == "READY" and handoff.output_ids == tuple(prefill.tokens_of("r"))

    decode.loop.handle(pickle.loads(pickle.dumps(handoff)))  # as through the pipe
    decode.turn()
    (imported,) = decode.out.of_type(KVImported)
    assert imported.offset == handoff.offset and pool.state(handoff.offset).name == "FREE"
    while decode.loop.scheduler.has_work:
        decode.turn()
    assert [d.reason for r in decode.out.of_type(StepReport) for d in r.done] == ["length"]
    tokens = [*handoff.output_ids, *decode.tokens_of("r")]
    assert tokens == colocated_tokens("a prompt longer than one chunk of thirty-two tokens")
    prefill.close()
    decode.close()


def test_prefill_waits_for_a_free_extent_and_exports_oldest_first(pool):
    prefill = Worker("prefill")
    prefill.loop.handle(AttachExtents(pool.names, max_extents=2))
    for i in range(3):
        submit(prefill, f"r{i}", f"prompt {i}")
    for _ in range(3):
        prefill.turn()
    assert [m.request_id for m in prefill.out.of_type(KVHandoff)] == ["r0", "r1"]  # two extents at most
    assert prefill.loop.role.has_work and [q.request_id for q in prefill.loop.scheduler.running] == ["r2"]
    pool.release(prefill.out.of_type(KVHandoff)[0].offset)  # the decode side freed one
    prefill.turn()
    assert [m.request_id for m in prefill.out.of_type(KVHandoff)] == ["r0", "r1", "r2"]
    assert not prefill.loop.role.has_work and not prefill.loop.scheduler.has_work
    prefill.close()


def test_cancelling_a_request_waiting_for_an_extent_drops_it_from_the_prefill_role(pool):
    prefill = Worker("prefill")  # no AttachExtents yet: every finished prompt waits
    submit(prefill, "r0", "prompt")
    prefill.turn()
    assert prefill.loop.role.has_work
    prefill.loop.handle(CancelRequest("r0"))
    assert not prefill.loop.role.has_work and not prefill.loop.scheduler.has_work and not prefill.ctx._seqs
    assert [(m.request_id, m.reason) for m in prefill.out.of_type(RequestDone)] == [("r0", "cancelled")]
    prefill.close()


def exported(pool: KVArena, request_id: str, text: str, fingerprint: str = FINGERPRINT, at: int = 0) -> KVHandoff:
    """A KVHandoff of ``text``'s prompt, exported by a bare prefill role (no loop) into ``pool`` at offset ``at``
    (each bare role has its own allocator: two of them must be told apart)."""
    model = FakeModel()
    ctx = FakeContext(model, n_ctx=N_CTX, n_batch=64, n_seq_max=1, n_threads=1)
    ids = model.tokenize(text)
    ctx.decode(ids, list(range(len(ids))), [0] * len(ids), [False] * (len(ids) - 1) + [True])
    sent, finished = [], []
    role = PrefillRole(ctx, sent.append, lambda seq, keep_prefix=False: finished.append(seq), fingerprint, arena=pool)
    role.allocator.head = at
    params = SamplingParams(max_tokens=6)
    seq = Sequence(request_id, ids, params, seq_id=0, n_prefilled=len(ids), output_ids=[40],
                   sampler=ctx.new_sampler(params), stream=TextStream())
    role.prompt_done(seq, 0.0)
    role.pump()
    assert finished == [seq]
    (handoff,) = sent
    return handoff


def test_decode_role_alone_imports_with_only_a_context_a_scheduler_and_send(pool):
    handoff = exported(pool, "r", "hello")
    ctx = FakeContext(FakeModel(), n_ctx=N_CTX, n_batch=64, n_seq_max=2, n_threads=1)
    scheduler = Scheduler(n_seq_max=2, n_ctx=N_CTX, n_batch=64, chunk=64)
    sent = []
    role = DecodeRole(ctx, sent.append, scheduler.release, FINGERPRINT, scheduler, arena=pool)
    assert role.handle(handoff) and role.has_work
    role.pump()
    (seq,) = scheduler.running
    assert seq.output_ids == [40] and seq.stream is handoff.stream
    # the sampler is built again on this side, with the output so far as its history
    assert seq.sampler.params == handoff.params and seq.sampler.reference.history == [40]
    assert ctx._seqs[seq.seq_id] == FakeModel().tokenize("hello")  # the prompt's KV, from the extent
    assert [type(m) for m in sent] == [KVImported] and pool.state(handoff.offset).name == "FREE"


def test_decode_role_waits_for_a_free_sequence(pool):
    first, second = exported(pool, "r0", "one"), exported(pool, "r1", "two", at=4 * 4096)
    ctx = FakeContext(FakeModel(), n_ctx=N_CTX, n_batch=64, n_seq_max=1, n_threads=1)
    scheduler = Scheduler(n_seq_max=1, n_ctx=N_CTX, n_batch=64, chunk=64)
    sent = []
    role = DecodeRole(ctx, sent.append, scheduler.release, FINGERPRINT, scheduler, arena=pool)
    role.handle(first)
    role.handle(second)
    role.pump()
    assert [m.request_id for m in sent] == ["r0"] and pool.state(second.offset).name == "READY"
    scheduler.release(scheduler.running[0])
    role.pump()
    assert [m.request_id for m in sent] == ["r0", "r1"] and not role.has_work


def test_decode_role_refuses_an_extent_of_another_model_and_frees_extent_and_sequence(pool):
    handoff = exported(pool, "r", "hello", fingerprint="0" * 64)
    decode = Worker("decode")
    decode.loop.handle(AttachExtents(pool.names))
    decode.loop.handle(handoff)
    decode.turn()
    (done,) = decode.out.sent
    assert isinstance(done, RequestDone) and done.reason == "error" and "KV import refused" in done.error
    assert pool.state(handoff.offset).name == "FREE" and not decode.loop.scheduler.has_work
    assert len(decode.loop.scheduler.allocator.free_seq_ids) == 4 and not decode.ctx._seqs
    decode.close()


def test_cancelling_a_pending_handoff_frees_its_extent(pool):
    handoff = exported(pool, "r", "hello")
    decode = Worker("decode", n_seq_max=1)
    decode.loop.handle(handoff)  # no AttachExtents yet: it stays pending
    decode.loop.handle(AttachExtents(pool.names))
    decode.loop.handle(CancelRequest("r"))
    assert [(m.request_id, m.reason) for m in decode.out.of_type(RequestDone)] == [("r", "cancelled")]
    assert pool.state(handoff.offset).name == "FREE" and not decode.loop.role.has_work
    decode.close()


def test_prefill_takes_exactly_the_state_bytes_and_gets_them_back_once_imported(pool):
    prefill, decode = Worker("prefill", n_ctx=2048), Worker("decode", n_ctx=2048)
    for w in (prefill, decode):
        w.loop.handle(AttachExtents(pool.names))
    submit(prefill, "r0", "x" * 1100)  # 1101 tokens: 4416 bytes of fake KV state
    while not prefill.out.of_type(KVHandoff):
        prefill.turn()
    (first,) = prefill.out.of_type(KVHandoff)
    assert first.n_bytes == 8 + 4 + 4 * 1101 and first.extent_bytes == 4096 + 2 * 4096  # header + 2 pages
    assert first.arena_used_bytes == first.extent_bytes and first.arena_kv_bytes == first.n_bytes
    decode.loop.handle(first)
    decode.turn()  # imported: the extent's state byte says FREE
    submit(prefill, "r1", "y")
    while len(prefill.out.of_type(KVHandoff)) < 2:
        prefill.turn()
    second = prefill.out.of_type(KVHandoff)[1]
    assert second.offset == first.extent_bytes  # the ring goes on after the first extent...
    assert second.arena_used_bytes == second.extent_bytes  # ...whose bytes came back to the allocator
    prefill.close()
    decode.close()


def test_a_state_that_can_never_fit_the_arena_fails_with_the_sizes_instead_of_waiting():
    with KVArena.create(8192) as arena:  # one page of header, one of payload
        prefill = Worker("prefill", n_ctx=4096)
        prefill.loop.handle(AttachExtents(arena.names))
        submit(prefill, "big", "z" * 2000)
        submit(prefill, "small", "hi")
        while prefill.loop.scheduler.has_work or prefill.loop.role.has_work:
            prefill.turn()
        (done,) = prefill.out.of_type(RequestDone)
        assert done.request_id == "big" and done.reason == "error"
        assert "8016 bytes (12288 with the extent header), the KV arena holds 8192" in done.error
        assert [m.request_id for m in prefill.out.of_type(KVHandoff)] == ["small"]  # the next one went on
        assert not prefill.loop.role.has_work and not prefill.ctx._seqs
        prefill.close()


def test_a_restarted_prefill_worker_leaves_the_extents_in_transit_alone(pool):
    handoff = exported(pool, "r", "hello")  # READY, waiting for the decode worker
    prefill = Worker("prefill")
    prefill.loop.handle(AttachExtents(pool.names, live_extents=((handoff.offset, handoff.extent_bytes),)))
    submit(prefill, "next", "another prompt")
    while not prefill.out.of_type(KVHandoff):
        prefill.turn()
    (after,) = prefill.out.of_type(KVHandoff)
    assert after.offset >= handoff.offset + handoff.extent_bytes
    assert pool.request_in(handoff.offset) == "r"
    assert after.arena_used_bytes == handoff.extent_bytes + after.extent_bytes
    prefill.close()
