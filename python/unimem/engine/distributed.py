"""Tensor parallelism across processes: one process per rank, torch.distributed groups, and
one schedule for all ranks.

Groups (:class:`TPGroups`, built by :func:`init_groups`). Every rank holds two groups over
the same ranks: the *device group*, through which the model all-reduces and all-gathers its
tensors (gloo on the CPU, NCCL on GPUs: the only switch is the backend the device picks),
and the *control group* (gloo, host memory), through which rank 0 broadcasts what the
scheduler needs and ranks compare their allocator state. They are torch.distributed backend
objects made from one ``TCPStore``; nothing global (no default process group) is created, so
one process can hold engines of different groups one after another.

Ranks agree without exchanging ids. Every rank runs the same scheduler on the same inputs:

* rank 0 (:class:`LeaderCore`, what the caller or the HTTP server drives) records every
  ``submit`` and ``abort`` and, at the start of each ``step``, broadcasts them over the
  control group; the other ranks (:func:`follow`) replay them in the same order and step;
* every rank's memory has the same geometry (the model's heads divide evenly, so each
  rank's ``HybridConfig`` is the same; the token budget is agreed once, as the minimum over
  ranks, before the pools are built);
* every rank picks the same tokens: logits are gathered across ranks, so every rank's
  argmax / sampler reads the same bits.

So virtual ids, ``v2p`` tables and compactions are identical on every rank although each
rank's arena holds only its heads. With ``UNIMEM_TP_CHECK_STATE=1`` every rank hashes its
host counters, device tables and scheduler state after every step and the hashes are
compared over the control group (:func:`check_agreement`); a difference raises
``RuntimeError`` naming the step and what differs. See ``docs/distributed.md``.

Processes (:class:`RankProcesses`): the caller is rank 0; ranks ``1..N-1`` are spawned with
``torch.multiprocessing`` (``spawn``) and run a function of their groups.

Several nodes (:class:`Topology`: SGLang's ``nnodes``, ``node_rank``, ``dist_init_addr``):
the ``N`` ranks are split evenly over the nodes, node ``k`` running ranks ``[k·N/nnodes,
(k+1)·N/nnodes)`` (local GPU ``i`` for its ``i``-th rank); every rank meets at the store that
rank 0 serves on ``dist_init_addr`` (``HOST:PORT``, an address of node 0 that the others
reach). On node 0 the caller is rank 0, as on one node; on another node the caller is that
node's first rank and runs what the other ranks run. The groups span every node, so the
start-up error exchange (:meth:`TPGroups.agree`) and the agreement check work across nodes
unchanged.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import secrets
import socket
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unimem.engine.core import EngineCore
from unimem.engine.request import Request
from unimem.memory.spec import LayerKind
from unimem.memory.unified import UnifiedMemory
from unimem.models.base import CausalLM
from unimem.models.tensor_parallel import TensorParallel
from unimem_kernel import envs

__all__ = [
    "CHECK_ENV",
    "Topology",
    "LeaderCore",
    "RankProcesses",
    "TPGroups",
    "check_agreement",
    "follow",
    "init_groups",
    "run_ranks",
    "state_check_for",
    "state_digests",
    "vocab_tables",
]

CHECK_ENV = "UNIMEM_TP_CHECK_STATE"
"""Set to ``1``: every rank checks after every step that its allocator state equals rank 0's
(debug: it reads device tables, so it synchronises; :mod:`unimem_kernel.envs`)."""

TIMEOUT_ENV = "UNIMEM_TP_TIMEOUT_S"
"""Seconds a collective may wait (:mod:`unimem_kernel.envs`; the default is a day: idle
ranks wait for rank 0's next step in a broadcast)."""


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=envs.get(TIMEOUT_ENV))


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """The device of ``rank``: ``cuda:rank`` on GPUs (one GPU per rank), else the CPU."""
    device = torch.device(device)
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Topology:
    """Where the ``size`` ranks run (module docstring): ``nnodes`` nodes of ``size //
    nnodes`` ranks, this process on node ``node_rank``, the store of rank 0 at
    ``dist_init_addr`` (``HOST:PORT``; None on one node: a free port of 127.0.0.1).
    ``ValueError`` naming the argument for an impossible layout."""

    size: int
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        for name in ("size", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        rank = self.node_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.nnodes:
            raise ValueError(f"node_rank must be an int in [0, nnodes={self.nnodes}), got {rank!r}")
        if self.size % self.nnodes:
            raise ValueError(
                f"tp_size ({self.size}) must be a multiple of nnodes ({self.nnodes}): "
                "every node runs the same number of ranks"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0's store)")
        if self.dist_init_addr is not None:
            parse_addr(self.dist_init_addr)

    @property
    def local_size(self) -> int:
        """Ranks on each node."""
        return self.size // self.nnodes

    @property
    def first_rank(self) -> int:
        """This node's first rank (the caller's)."""
        return self.node_rank * self.local_size


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``; ``ValueError`` naming
    ``dist_init_addr`` otherwise."""
    host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
    return host, int(port)


# ---------------------------------------------------------------------- groups


@dataclass
class TPGroups:
    """This rank's groups (module docstring). Implements the model's
    :class:`~unimem.models.tensor_parallel.Communicator` over the device group."""

    rank: int
    size: int
    device: torch.device
    device_group: object
    control_group: object
    store: object

    # -- the model's collectives (device group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.device_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([out], [x]).wait()
        return out

    def tensor_parallel(self) -> TensorParallel:
        """What a model of this rank is built with."""
        return TensorParallel(self.rank, self.size, self)

    # -- control (gloo, host memory)

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        """``obj`` of rank ``src`` (pickled) on every rank."""
        data = pickle.dumps(obj) if self.rank == src else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self.control_group.broadcast(length, src).wait()
        buf = torch.empty(int(length), dtype=torch.uint8)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.control_group.broadcast(buf, src).wait()
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (any lengths), in rank order."""
        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.empty_like(length) for _ in range(self.size)]
        self.control_group.allgather([lengths], [length]).wait()
        width = max(int(n) for n in lengths)
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self.control_group.allgather([out], [mine]).wait()
        return [t[: int(n)].numpy().tobytes() for t, n in zip(out, lengths, strict=True)]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""
        return min(pickle.loads(b) for b in self.all_gather_bytes(pickle.dumps(int(value))))

    def agree(self, error: BaseException | None) -> None:
        """Every rank says whether its last local step failed; if any did, every rank
        raises: its own exception, or ``ValueError`` with the first failing rank's message.
        (A failure on one rank would otherwise leave the others waiting in a collective.)"""
        mine = b"" if error is None else f"{type(error).__name__}: {error}".encode()
        msgs = self.all_gather_bytes(mine)
        failed = [(r, m.decode()) for r, m in enumerate(msgs) if m]
        if not failed:
            return
        if error is not None:
            raise error
        rank, msg = failed[0]
        raise ValueError(f"tensor-parallel rank {rank} failed: {msg}")


def free_port() -> int:
    """An unused TCP port on this host (for the rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_groups(
    rank: int,
    size: int,
    port: int,
    device: str | torch.device,
    host: str = "127.0.0.1",
    store: dist.TCPStore | None = None,
    namespace: str = "",
    local_rank: int | None = None,
) -> TPGroups:
    """Join the ``size`` ranks meeting at ``host:port`` (rank 0 serves the store; it may pass
    the ``store`` it already serves): the device group (NCCL for a CUDA ``device``, else
    gloo) and the gloo control group. ``namespace``: a prefix of every key, shared by the
    ranks of one group only (a stray process reaching the port cannot join them).
    ``local_rank``: the rank's index on its node, which picks its GPU (default ``rank``: one
    node)."""
    timeout = _timeout()
    dev = rank_device(device, rank if local_rank is None else local_rank)
    if store is None:
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
    ns = f"{namespace}/" if namespace else ""
    control = dist.ProcessGroupGloo(dist.PrefixStore(ns + "control", store), rank, size, timeout)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore(ns + "device", store), rank, size, opts)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore(ns + "device", store), rank, size, timeout)
    return TPGroups(rank, size, dev, group, control, store)


# ---------------------------------------------------------------------- processes


def _rank_main(
    rank: int,
    size: int,
    port: int,
    namespace: str,
    device: str,
    fn: Callable,
    args: tuple,
    host: str = "127.0.0.1",
    local_rank: int | None = None,
) -> None:
    try:
        groups = init_groups(
            rank, size, port, device, host, namespace=namespace, local_rank=local_rank
        )
        fn(groups, *args)
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


class RankProcesses:
    """This node's ranks but the first as spawned processes, each running ``fn(groups,
    *args)``; the caller joins as the node's first rank (:attr:`groups`; rank 0 on node 0).
    ``topology``: the nodes (default: all ``size`` ranks here). ``fn`` and ``args`` must
    pickle (a module-level function).

    On one node, rank 0 serves the rendezvous store on a port the OS picks while it binds (no
    free-port guess another process could take in between) and the ranks meet under a
    namespace of their own, so concurrent groups on one host never join each other. Across
    nodes the ranks meet at ``dist_init_addr``, which every node is given, without a
    namespace (nodes cannot share a random one)."""

    def __init__(
        self, size: int, device: str, fn: Callable, *args, topology: Topology | None = None
    ) -> None:
        topo = topology or Topology(size)
        if not isinstance(size, int) or size < 2 or topo.size != size:
            raise ValueError(f"tp_size must be an int >= 2 to spawn ranks, got {size!r}")
        local = topo.local_size
        if torch.device(device).type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(
                f"tp_size {size} needs {local} GPUs on this node, "
                f"{torch.cuda.device_count()} visible"
            )
        first = topo.first_rank
        store = None
        if topo.dist_init_addr is None:
            host = "127.0.0.1"
            store = dist.TCPStore(host, 0, size, True, timeout=_timeout(), wait_for_workers=False)
            port, namespace = store.port, secrets.token_hex(8)
        else:
            (host, port), namespace = parse_addr(topo.dist_init_addr), ""
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(first + i, size, port, namespace, device, fn, args, host, i),
                daemon=True,
            )
            for i in range(1, local)
        ]
        for p in self.procs:
            p.start()
        self.topology = topo
        self.groups = init_groups(
            first, size, port, device, host, store=store, namespace=namespace, local_rank=0
        )

    def join(self, timeout: float = 60.0) -> list[int]:
        """Wait for the ranks to exit; the ranks that failed (non-zero exit, or still running
        after ``timeout`` seconds: then killed)."""
        failed = []
        for r, p in enumerate(self.procs, 1):
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
            if p.exitcode != 0:
                failed.append(r)
        return failed


def run_ranks(
    size: int, fn: Callable, *args, device: str = "cpu", topology: Topology | None = None
):
    """Run ``fn(groups, *args)`` on ``size`` ranks (SPMD: the caller is this node's first
    rank, the node's others are spawned) and return the caller's result (rank 0's on node
    0). ``RuntimeError`` if another rank of this node failed."""
    ranks = RankProcesses(size, device, fn, *args, topology=topology)
    try:
        result = fn(ranks.groups, *args)
    finally:
        failed = ranks.join()
    if failed:
        raise RuntimeError(f"tensor-parallel ranks {failed} failed (their errors are on stderr)")
    return result


# ---------------------------------------------------------------------- one schedule


class LeaderCore(EngineCore):
    """Rank 0's :class:`EngineCore`: what callers drive. ``submit``, ``abort`` and
    ``restart_request_ids`` act here at once and are recorded; each ``step`` first broadcasts
    them to the other ranks (which replay them in :func:`follow`), then steps. :meth:`stop`
    ends the other ranks' loops. Constructor: :class:`EngineCore`'s arguments and ``groups=``."""

    def __init__(self, *args, groups: TPGroups, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.groups = groups
        self.check_state = envs.get(CHECK_ENV)
        self._ops: list[tuple] = []
        self._stopped = False

    def submit(
        self, prompt, max_new_tokens, stop_token_ids=(), sampling=None, **prompt_logprobs
    ) -> Request:
        req = super().submit(prompt, max_new_tokens, stop_token_ids, sampling, **prompt_logprobs)
        stops = sorted(req.stop_token_ids)
        op = ("submit", list(req.prompt), max_new_tokens, stops, sampling, prompt_logprobs)
        self._ops.append(op)
        return req

    def abort(self, req: Request) -> bool:
        done = super().abort(req)
        if done:
            self._ops.append(("abort", req.rid))
        return done

    def restart_request_ids(self) -> None:
        super().restart_request_ids()
        self._ops.append(("restart_ids",))

    def step(self) -> bool:
        if self._stopped:
            raise RuntimeError("this tensor-parallel engine was stopped")
        ops, self._ops = self._ops, []
        self.groups.broadcast_object(("step", ops))
        more = super().step()
        if self.check_state:
            check_agreement(self, self.groups)
        return more

    def stop(self) -> None:
        """End the other ranks' :func:`follow` loops (idempotent); returns once every rank
        has left its loop (no collective of theirs is pending when the caller goes on to
        join their processes)."""
        if not self._stopped:
            self._stopped = True
            self.groups.broadcast_object(("stop", []))
            self.groups.control_group.barrier().wait()


def follow(core: EngineCore, groups: TPGroups) -> None:
    """The loop of ranks other than 0: receive each step's submissions, aborts and request-id
    restarts from rank 0, replay them in order on ``core``, step — until rank 0 stops."""
    check = envs.get(CHECK_ENV)
    live: dict[int, Request] = {}
    while True:
        cmd, ops = groups.broadcast_object()
        for op in ops:
            if op[0] == "submit":
                _, prompt, max_new, stops, sampling, prompt_logprobs = op
                req = core.submit(prompt, max_new, stops, sampling, **prompt_logprobs)
                live[req.rid] = req
            elif op[0] == "restart_ids":  # rank 0's ids restarted (after a warm-up)
                core.restart_request_ids()
                live = {}
            else:
                core.abort(live[op[1]])
        if cmd == "stop":
            groups.control_group.barrier().wait()  # rank 0 learns that this rank is done
            return
        core.step()
        if check:
            check_agreement(core, groups)
        live = {rid: r for rid, r in live.items() if not r.finished}


# ---------------------------------------------------------------------- agreement


def _tensor_bytes(t: torch.Tensor | None) -> bytes:
    return b"" if t is None else t.detach().cpu().contiguous().numpy().tobytes()


def _requests(reqs: Iterable[Request]) -> list[tuple]:
    out = []
    for r in reqs:
        mem = None
        if r.mem is not None:
            mem = (r.mem.row, r.mem.state_slot, tuple(r.mem.pages), r.mem.swa_start)
        out.append((r.rid, r.status.name, r.kv_len, tuple(r.output), mem, len(r.inflight)))
    return out


def state_digests(core: EngineCore) -> dict[str, bytes]:
    """SHA-256 digests of what must be identical on every rank after a step: ``host`` (the
    pool's counters, band extents and holder counts), ``tables`` (the device tables: request
    table, ``v2p`` / ``p2v``, free stacks) and ``requests`` (the scheduler's queues and each
    request's ids and outputs). Reads the device: debug only."""
    pool, sched = core.pool, core.scheduler
    stats = pool.stats
    host = [
        type(pool).__name__,
        (stats.used_bytes, stats.peak_bytes, stats.compactions, stats.moved_units),
        stats.retired_swa_pages,
        sorted(pool.holders()[0].items()),
        sorted(pool.holders()[1].items()),
        [pool.live_units(k) for k in (LayerKind.FULL, LayerKind.SWA, LayerKind.STATE)],
    ]
    tables = [pool.req_to_token, pool.full_v2p, pool.swa_v2p, pool.state_v2p]
    if isinstance(pool, UnifiedMemory):  # band extents, translation and free stacks
        host.append([(b.lo, b.hi, b.free) for b in pool.bands.bands])
        for space in pool.spaces.values():
            tables += [space.p2v, space.free_stack[: space.free]]
    requests = [
        _requests(sched.running),
        [r.rid for r in sched.waiting],
        [r.rid for r in sched.finished],
        sched.retractions,
        core.steps,
    ]
    h = hashlib.sha256
    return {
        "host": h(repr(host).encode()).digest(),
        "tables": h(b"|".join(_tensor_bytes(t) for t in tables)).digest(),
        "requests": h(repr(requests).encode()).digest(),
    }


def check_agreement(core: EngineCore, groups: TPGroups) -> None:
    """All ranks compare :func:`state_digests` (over the control group); ``RuntimeError``
    naming the step and the parts that differ from rank 0's, on every rank."""
    mine = state_digests(core)
    names = sorted(mine)
    every = groups.all_gather_bytes(b"".join(mine[n] for n in names))
    width = len(mine[names[0]])
    diffs = []
    for r, data in enumerate(every[1:], 1):
        for i, n in enumerate(names):
            if data[i * width : (i + 1) * width] != every[0][i * width : (i + 1) * width]:
                diffs.append(f"{n} on rank {r}")
    if diffs:
        raise RuntimeError(
            f"tensor-parallel ranks disagree after step {core.steps}: {', '.join(diffs)} "
            "differ from rank 0"
        )


def state_check_for(model: CausalLM) -> Callable[[EngineCore], None] | None:
    """The per-step agreement check for engines over ``model`` when it is a rank of a
    :class:`TPGroups` group and ``UNIMEM_TP_CHECK_STATE=1``; None otherwise."""
    groups = model.tp.comm
    if model.tp.size == 1 or not isinstance(groups, TPGroups):
        return None
    if not envs.get(CHECK_ENV):
        return None
    return lambda core: check_agreement(core, groups)


# ---------------------------------------------------------------------- drafter tables


def vocab_tables(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """The full ``[vocab, d_model]`` embedding and LM head of a tensor-parallel ``model``
    (its ranks' vocabulary rows gathered, padding cut), for a drafter replicated on every
    rank; the model's own tensors when unsharded."""
    tp, vocab = model.tp, model.config.vocab_size
    if tp.size == 1:
        return model.embed_weight, model.lm_head_weight

    def gather(w: torch.Tensor) -> torch.Tensor:
        return torch.cat(tp.comm.all_gather(w.contiguous()), dim=0)[:vocab]

    embed = gather(model.embed_weight)
    same = model.lm_head_weight.data_ptr() == model.embed_weight.data_ptr()
    return embed, embed if same else gather(model.lm_head_weight)
