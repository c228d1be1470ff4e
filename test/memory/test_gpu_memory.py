"""The memory layer on CUDA: the stateful properties, and a step loop that never syncs.

Two drivers, each run on CPU (fast, plain tests) and on CUDA (``gpu`` tests):

- :class:`RandomDriver`: seeded random admit / grow / retire-SWA / finish / compact on a
  poisoned :class:`UnifiedMemory`; after every step ``check_unified``, every live unit still
  holds the bytes last written through its virtual id, every free or gap byte is poison, the
  sinks are zero, and every handed-out unit started zeroed. The same properties as the
  hypothesis machine of ``test_unified_stateful.py``, whose expected bytes and masks are CPU
  tensors; here they live on the pool's device and the operation sequence is seeded.
- :class:`ServingLoop`: what a scheduler does each step (admit a few requests, grow every
  running one by a few tokens, retract on failure, retire SWA, release finished ones, compact
  a band now and then). It reads nothing back from the device, so on CUDA it runs under
  ``torch.cuda.set_sync_debug_mode("error")``: any host sync in the memory layer's step path
  raises. The invariants are checked afterwards (``check_unified`` syncs).
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from specs import SPECS as TINY_SPECS
from specs import F, S, T

from unimem.memory.checks import check_unified
from unimem.memory.layout import MemoryLayout
from unimem.memory.pool import POISON_BYTE, MemoryPool, RequestMemory
from unimem.memory.spec import LayerKind, MemorySpec
from unimem.memory.staging import upload_int32
from unimem.memory.static import StaticMemory
from unimem.memory.unified import UnifiedMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset
from unimem_kernel import id_ops, unit_ops


def _small_spec() -> MemorySpec:
    """The ``small`` preset (one H200): 128 KiB pages, 8.3 MiB state slots, window 512."""
    return memory_spec(preset("small"), 16)


@pytest.fixture
def one_thread():
    """CPU tests here run many tiny indexing ops, which a multi-threaded pool slows down."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextmanager
def no_host_sync():
    """Any synchronising CUDA call inside raises (PyTorch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _max_unit_bytes(spec: MemorySpec) -> int:
    lay = MemoryLayout.build(spec)
    return max(lay.unit_bytes(k) for k in spec.kinds)


# ---------------------------------------------------------------------------------------------
# (a) random admit / grow / retire / finish / compact with data checks after every step
# ---------------------------------------------------------------------------------------------


class RandomDriver:
    """Seeded random pool operations with the data a model would write into each unit.

    Every handed-out unit is checked to be zero, then filled with random bytes that must
    survive every later step (compaction included) until the unit is freed.
    """

    def __init__(self, mem: UnifiedMemory, seed: int, max_tokens: int) -> None:
        self.mem = mem
        self.rng = random.Random(seed)
        self.gen = torch.Generator(device=mem.device).manual_seed(seed)
        self.max_tokens = max_tokens
        self.live: dict[int, tuple[RequestMemory, int]] = {}  # row -> (request, tokens)
        self.data: dict[tuple[LayerKind, int], torch.Tensor] = {}

    # --- units -----------------------------------------------------------------------------------

    def _span(self, kind: LayerKind, phys: int) -> tuple[int, int]:
        ub = self.mem.layout.unit_bytes(kind)
        start = self.mem.base[kind] + phys * ub
        return start, start + ub

    def _view(self, kind: LayerKind, vid: int) -> torch.Tensor:
        phys = int(self.mem.spaces[kind].v2p[vid])
        assert phys > 0 or (kind is T and phys >= 0), f"{kind} {vid} unbound"
        lo, hi = self._span(kind, phys)
        return self.mem.arena[lo:hi]

    def _hand_out(self, kind: LayerKind, vids: list[int]) -> None:
        for v in vids:
            view = self._view(kind, v)
            assert not bool(view.any()), f"{kind} unit {v} not zeroed on hand-out"
            pattern = torch.randint(
                0, 255, view.shape, generator=self.gen, dtype=torch.uint8, device=view.device
            )
            view.copy_(pattern)
            self.data[(kind, v)] = pattern

    def _forget(self, kind: LayerKind, vids: list[int]) -> None:
        for v in vids:
            del self.data[(kind, v)]

    def _new_pages(self, req: RequestMemory, before: int) -> None:
        self._hand_out(F, req.pages[before:])
        if self.mem.spec.has(S):
            self._hand_out(S, req.pages[before:])

    # --- operations ------------------------------------------------------------------------------

    def admit(self) -> None:
        tokens = self.rng.randint(1, self.max_tokens)
        req = self.mem.admit(tokens)
        if req is None:
            return
        self._new_pages(req, 0)
        if self.mem.spec.has(T):
            self._hand_out(T, [req.state_slot])
        self.live[req.row] = (req, tokens)

    def grow(self, everyone: bool) -> None:
        rows = sorted(self.live)
        if not everyone:
            rows = [self.rng.choice(rows)]
        extra = self.rng.randint(1, 3 * self.mem.page_size)
        batch = [
            (self.live[r][0], min(self.live[r][1] + extra, self.mem.max_context)) for r in rows
        ]
        before = {req.row: len(req.pages) for req, _ in batch}
        if self.mem.grow(batch):
            for req, target in batch:
                self._new_pages(req, before[req.row])
                self.live[req.row] = (req, target)
        else:
            assert all(len(req.pages) == before[req.row] for req, _ in batch), "not all-or-nothing"

    def retire_swa(self) -> None:
        batch = list(self.live.values())
        starts = {req.row: req.swa_start for req, _ in batch}
        n = self.mem.retire_swa(batch)
        retired = 0
        for req, _ in batch:
            if self.mem.spec.has(S):
                self._forget(S, req.pages[starts[req.row] : req.swa_start])
            retired += req.swa_start - starts[req.row]
        assert n == retired

    def finish(self) -> None:
        row = self.rng.choice(sorted(self.live))
        req, _ = self.live.pop(row)
        self._forget(F, req.pages)
        if self.mem.spec.has(S):
            self._forget(S, req.pages[req.swa_start :])
        if self.mem.spec.has(T):
            self._forget(T, [req.state_slot])
        self.mem.release([req])

    def compact(self) -> None:
        kind = self.rng.choice(self.mem.kinds)
        sides = self.mem.bands.sides(self.mem._band_index[kind])
        self.mem.compact(kind, self.rng.choice(sides))

    def step(self) -> str:
        ops = ["admit", "compact"]
        if self.live:
            ops += ["grow", "grow_all", "retire", "finish", "grow", "admit"]
        op = self.rng.choice(ops)
        if op == "admit":
            self.admit()
        elif op == "grow":
            self.grow(everyone=False)
        elif op == "grow_all":
            self.grow(everyone=True)
        elif op == "retire":
            self.retire_swa()
        elif op == "finish":
            self.finish()
        else:
            self.compact()
        return op

    # --- checks (they synchronise) --------------------------------------------------------------

    def check(self) -> None:
        m = self.mem
        check_unified(m, [req for req, _ in self.live.values()])
        v2p = {k: s.v2p.cpu() for k, s in m.spaces.items()}
        owned = torch.zeros(m.arena_bytes, dtype=torch.bool, device=m.device)
        owned[: m.header_bytes] = True
        for (kind, v), pattern in self.data.items():
            lo, hi = self._span(kind, int(v2p[kind][v]))
            assert torch.equal(m.arena[lo:hi], pattern), f"{kind} unit {v} changed"
            owned[lo:hi] = True
        free = torch.where(owned, POISON_BYTE, m.arena)
        assert bool((free == POISON_BYTE).all()), "a free byte is not poison"
        assert not bool(m.arena[: m.header_bytes].any()), "a sink is not zero"


def _random_run(spec: MemorySpec, device: str, seed: int, steps: int, units: int) -> None:
    per_unit = _max_unit_bytes(spec)
    max_context = 48 * spec.page_size if spec.page_size < 16 else 64 * spec.page_size
    mem = UnifiedMemory(
        spec,
        arena_bytes=units * per_unit,
        max_requests=6,
        max_context=max_context,
        device=device,
        poison=True,
    )
    driver = RandomDriver(mem, seed, max_tokens=max_context // 2)
    seen = set()
    for _ in range(steps):
        seen.add(driver.step())
        driver.check()
    assert {"admit", "grow", "compact"} <= seen


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (root conftest)"
)
@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_random_ops_cpu(name, one_thread, monkeypatch):
    """The Triton kernels, run on CPU by the interpreter (the dispatcher picks them when
    ``UNIMEM_KERNEL_BACKEND=triton``); small, so the interpreter stays fast."""
    monkeypatch.setenv("UNIMEM_KERNEL_BACKEND", "triton")
    launched = []
    for module, op in ((id_ops, "bind_units"), (id_ops, "compact_band"), (unit_ops, "fill_units")):
        kernel = getattr(module, f"{op}_triton")

        def spy(*args, _kernel=kernel, _op=op, **kwargs):
            launched.append(_op)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, f"{op}_triton", spy)
    for seed in range(2):
        _random_run(TINY_SPECS[name], "cpu", seed, steps=60, units=16)
    assert {"bind_units", "compact_band", "fill_units"} <= set(launched), "a kernel did not run"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full+swa+state", "small"])
def test_random_ops_cuda(name):
    # Two geometries only: every new one costs a round of Triton compiles. The other tiny specs
    # run the same kernels on CPU through the interpreter (UNIMEM_KERNEL_BACKEND=triton).
    if name == "small":
        # Units are 128 KiB pages and 8.3 MiB slots: 12 of the largest make a tight arena.
        _random_run(_small_spec(), "cuda", seed=0, steps=80, units=12)
    else:
        for seed in range(2):
            _random_run(TINY_SPECS[name], "cuda", seed, steps=80, units=16)


# ---------------------------------------------------------------------------------------------
# (b) a serving loop with no host reads: under sync-debug "error" on CUDA
# ---------------------------------------------------------------------------------------------


@dataclass
class Running:
    req: RequestMemory
    tokens: int
    target: int


class ServingLoop:
    """The memory calls of a continuous-batching scheduler, decided from host counts only.

    Each step: admit up to three requests (while they fit and rows are free), grow every
    running request by the same 1..8 tokens (a verify step's ``gamma + 1``; on failure the
    newest request is retracted and the grow retried), retire SWA pages behind the window,
    release finished requests (and, rarely, an aborted one), and every ``compact_every`` steps
    compact one band of a unified pool explicitly.
    """

    def __init__(
        self,
        mem: MemoryPool,
        seed: int,
        max_prompt: int,
        max_new: int,
        max_running: int,
        compact_every: int = 7,
    ) -> None:
        self.mem = mem
        self.rng = random.Random(seed)
        self.max_prompt = max_prompt
        self.max_new = max_new
        self.max_running = max_running
        self.compact_every = compact_every
        self.running: list[Running] = []
        self.steps = 0
        self.admitted = self.finished = self.retracted = self.retired = self.compacted = 0

    def step(self) -> None:
        mem, rng = self.mem, self.rng
        for _ in range(rng.randint(0, 3)):
            if len(self.running) >= self.max_running or mem.free_rows == 0:
                break
            prompt = rng.randint(1, self.max_prompt)
            req = mem.admit(prompt)
            if req is None:
                break
            target = min(prompt + rng.randint(1, self.max_new), mem.max_context)
            self.running.append(Running(req, prompt, target))
            self.admitted += 1

        extra = rng.randint(1, 8)
        while self.running:
            batch = [(r.req, min(r.tokens + extra, r.target)) for r in self.running]
            if mem.grow(batch):
                for r, (_, tokens) in zip(self.running, batch, strict=True):
                    r.tokens = tokens
                break
            mem.release([self.running.pop().req])
            self.retracted += 1

        self.retired += mem.retire_swa([(r.req, r.tokens) for r in self.running])

        done = [r for r in self.running if r.tokens >= r.target or rng.random() < 0.02]
        if done:
            mem.release([r.req for r in done])
            self.running = [r for r in self.running if r not in done]
            self.finished += len(done)

        self.steps += 1
        if isinstance(mem, UnifiedMemory) and self.steps % self.compact_every == 0:
            kind = mem.kinds[(self.steps // self.compact_every) % len(mem.kinds)]
            side = rng.choice(mem.bands.sides(mem._band_index[kind]))
            self.compacted += mem.compact(kind, side) > 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    @property
    def requests(self) -> list[RequestMemory]:
        return [r.req for r in self.running]


def check_bytes(mem: UnifiedMemory, requests: list[RequestMemory]) -> None:
    """Live units hold zeros (the loop writes nothing, so this checks zero-on-hand-out and
    that compaction moved zeros); every other byte is poison (or zero without poison mode)."""
    v2p = {k: s.v2p.cpu() for k, s in mem.spaces.items()}
    live: dict[LayerKind, list[int]] = {k: [] for k in mem.spaces}
    for req in requests:
        if F in live:
            live[F] += [int(v2p[F][v]) for v in req.pages]
        if S in live:
            live[S] += [int(v2p[S][v]) for v in req.pages[req.swa_start :]]
        if T in live:
            live[T].append(int(v2p[T][req.state_slot]))
    owned = torch.zeros(mem.arena_bytes, dtype=torch.bool, device=mem.device)
    owned[: mem.header_bytes] = True
    for kind, phys in live.items():
        ub = mem.layout.unit_bytes(kind)
        for p in phys:
            lo = mem.base[kind] + p * ub
            owned[lo : lo + ub] = True
    assert not bool(mem.arena[owned].any()), "a live unit or a sink holds non-zero bytes"
    free_byte = POISON_BYTE if mem.poison else 0
    assert bool((mem.arena[~owned] == free_byte).all()), "a free byte is not the fill value"


def _cpu_pool(static: bool, poison: bool) -> MemoryPool:
    # Units of a few hundred bytes (the CPU references index every byte); pages of 4 tokens,
    # windows of 6 and 9; room for about half of 8 requests, so the loop meets retractions and
    # plan-driven band moves as well as explicit compactions.
    spec = TINY_SPECS["full+swa+state"]
    if static:
        return StaticMemory(spec, 60, 20, 5, max_requests=8, max_context=128, poison=poison)
    arena = 40 * _max_unit_bytes(spec)
    return UnifiedMemory(spec, arena, max_requests=8, max_context=128, poison=poison)


def _cpu_loop(mem: MemoryPool, seed: int) -> ServingLoop:
    return ServingLoop(mem, seed, max_prompt=40, max_new=24, max_running=8, compact_every=5)


def _small_unified(poison: bool) -> UnifiedMemory:
    # small preset: a request of ~1.4K tokens holds ~27 MiB; 192 MiB cannot hold 12 of them,
    # so the loop meets retractions and plan-driven band moves as well as explicit compactions.
    return UnifiedMemory(
        _small_spec(), 192 << 20, max_requests=12, max_context=4096, device="cuda", poison=poison
    )


def _small_loop(mem: MemoryPool, seed: int) -> ServingLoop:
    return ServingLoop(mem, seed, max_prompt=1200, max_new=200, max_running=12, compact_every=6)


@pytest.mark.parametrize("poison", [False, True])
def test_serving_loop_cpu(poison, one_thread):
    mem = _cpu_pool(static=False, poison=poison)
    loop = _cpu_loop(mem, seed=1)
    for _ in range(10):
        loop.run(20)
        check_unified(mem, loop.requests)
    check_bytes(mem, loop.requests)
    assert loop.admitted and loop.finished and loop.retired and loop.compacted
    assert loop.retracted and mem.stats.compactions > loop.compacted


def test_serving_loop_cpu_static(one_thread):
    mem = _cpu_pool(static=True, poison=True)
    loop = _cpu_loop(mem, seed=2)
    loop.run(200)
    _check_static(mem, loop.requests)
    assert loop.admitted and loop.finished and loop.retired and loop.retracted


def _check_static(mem: StaticMemory, requests: list[RequestMemory]) -> None:
    p = mem.page_size
    r2t = mem.req_to_token.cpu()
    swa = mem.swa_v2p.cpu() if mem.swa_v2p is not None else None
    for req in requests:
        want = torch.tensor([v * p + o for v in req.pages for o in range(p)], dtype=torch.int32)
        assert torch.equal(r2t[req.row, : want.numel()], want), f"row {req.row}: table"
        if swa is not None and req.pages:
            v = torch.tensor(req.pages)
            assert bool((swa[v[req.swa_start :]] > 0).all()), f"row {req.row}: SWA unbound"
            assert bool((swa[v[: req.swa_start]] == -1).all()), f"row {req.row}: SWA retired"


@pytest.mark.gpu
def test_sync_debug_mode_catches_a_sync():
    """The harness is live: a read-back inside ``no_host_sync`` raises."""
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError), no_host_sync():
        x.sum().item()
    with pytest.raises(RuntimeError), no_host_sync():
        torch.tensor([1, 2, 3], device="cuda")


@pytest.mark.gpu
def test_upload_int32_does_not_sync():
    dev = torch.device("cuda")
    want = np.arange(1000, dtype=np.int32)
    upload_int32(want, dev)  # first use: pinned allocator and copy engines warm
    torch.cuda.synchronize()
    with no_host_sync():
        outs = [upload_int32(want[: 10 * i], dev) for i in range(1, 60)]
        outs.append(upload_int32(list(range(7)), dev))
        outs.append(upload_int32(np.zeros(0, dtype=np.int32), dev))
    torch.cuda.synchronize()
    for i, t in enumerate(outs[:-2], start=1):
        assert np.array_equal(t.cpu().numpy(), want[: 10 * i])
    assert outs[-2].cpu().tolist() == list(range(7)) and outs[-1].numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("poison", [False, True])
def test_serving_loop_cuda_no_host_sync(poison):
    """200 steps of admit / grow / retract / retire / release / compact with every synchronising
    CUDA call an error; then the invariants, zero-on-hand-out and the poison fill."""
    mem = _small_unified(poison)
    loop = _small_loop(mem, seed=3)
    loop.run(40)  # warm-up: first launches and Triton compiles of every op variant
    torch.cuda.synchronize()
    before = (loop.admitted, loop.finished, loop.retracted, loop.retired, loop.compacted)
    moves = mem.stats.compactions
    with no_host_sync():
        loop.run(200)
    torch.cuda.synchronize()
    check_unified(mem, loop.requests)
    check_bytes(mem, loop.requests)
    after = (loop.admitted, loop.finished, loop.retracted, loop.retired, loop.compacted)
    # Every kind of step happened inside the checked region.
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert mem.stats.compactions - moves > loop.compacted - before[4], "no plan-driven move"


@pytest.mark.gpu
def test_serving_loop_cuda_static_no_host_sync():
    spec = _small_spec()
    mem = StaticMemory.from_budget(
        spec, 192 << 20, 6, 0.5, max_requests=12, max_context=4096, device="cuda", poison=True
    )
    loop = _small_loop(mem, seed=4)
    loop.run(40)
    torch.cuda.synchronize()
    with no_host_sync():
        loop.run(200)
    torch.cuda.synchronize()
    _check_static(mem, loop.requests)
    assert loop.finished and loop.retired
