"""One id space on the device: ``v2p``, ``p2v`` and the free stack of physical ids.

The device holds *which* ids (the tables and the free stack); the host holds *how many*
(``free``, the stack's height). Every method is a fixed number of launches of
``unimem_kernel`` ops with host ints as arguments: nothing here reads device memory on the
host, so none of it waits for the GPU.

Tables are allocated once and only mutated in place, so their addresses are stable for CUDA
graphs that read them (the attention metadata builder re-reads ``v2p`` on every replay).
"""

from __future__ import annotations

import torch

import unimem_kernel as uk


class IdSpace:
    """``v2p[num_virtual]``, ``p2v[num_physical]``, ``free_stack[num_physical]`` (int32).

    ``free`` is the number of physical ids on the stack (the first ``free`` entries). Which
    physical ids may go on the stack is the owner's business (a band pushes the ids of its
    extent); the stack never holds an id twice.
    """

    def __init__(self, name: str, num_virtual: int, num_physical: int, device: torch.device):
        self.name = name
        self.num_virtual = num_virtual
        self.num_physical = num_physical
        self.device = device
        self.v2p = torch.full((num_virtual,), -1, dtype=torch.int32, device=device)
        self.p2v = torch.full((num_physical,), -1, dtype=torch.int32, device=device)
        self.free_stack = torch.zeros(num_physical, dtype=torch.int32, device=device)
        self.free = 0
        # Source/destination pairs of the latest compaction (rows 0 and 1), allocated once:
        # the caller's copy is queued before any later compaction can overwrite them. Zeroed,
        # so that two pools that made the same moves hold the same bytes.
        self._moves = torch.zeros((2, num_physical), dtype=torch.int32, device=device)

    def push_range(self, lo: int, hi: int) -> torch.Tensor:
        """Push the fresh ids ``[lo, hi)``; returns the stack slice that now holds them."""
        n = hi - lo
        if n <= 0:
            return self.free_stack[:0]
        if self.free + n > self.num_physical:
            raise RuntimeError(f"{self.name}: free stack overflow")
        dst = self.free_stack[self.free : self.free + n]
        torch.arange(lo, hi, dtype=torch.int32, device=self.device, out=dst)
        self.free += n
        return dst

    def bind(
        self,
        vids: torch.Tensor,
        req_to_token: torch.Tensor | None = None,
        unit_rows: torch.Tensor | None = None,
        unit_cols: torch.Tensor | None = None,
        page_size: int = 1,
    ) -> torch.Tensor:
        """Pop ``len(vids)`` physical ids and bind them to ``vids`` (device int32).

        Optionally writes the pages into the request table (see ``unimem_kernel.bind_units``).
        Returns the stack slice holding the popped physical ids; it stays valid until the next
        push, so callers use it at once (e.g. to zero the handed-out units).
        """
        n = vids.numel()
        if n > self.free:
            raise RuntimeError(f"{self.name}: bind of {n} ids with {self.free} free")
        popped = self.free_stack[self.free - n : self.free]
        uk.bind_units(
            self.v2p,
            self.p2v,
            self.free_stack,
            self.free,
            n,
            vids,
            req_to_token=req_to_token,
            unit_rows=unit_rows,
            unit_cols=unit_cols,
            page_size=page_size,
        )
        self.free -= n
        return popped

    def unbind(
        self,
        n: int,
        vids: torch.Tensor | None = None,
        req_to_token: torch.Tensor | None = None,
        unit_rows: torch.Tensor | None = None,
        unit_cols: torch.Tensor | None = None,
        page_size: int = 1,
    ) -> torch.Tensor:
        """Unbind ``n`` bound virtual ids (given, or read from the request table) and push
        their physical ids. Returns the stack slice holding the pushed ids."""
        if n == 0:
            return self.free_stack[:0]
        pushed = self.free_stack[self.free : self.free + n]
        uk.unbind_units(
            self.v2p,
            self.p2v,
            self.free_stack,
            self.free,
            n,
            vids=vids,
            req_to_token=req_to_token,
            unit_rows=unit_rows,
            unit_cols=unit_cols,
            page_size=page_size,
        )
        self.free += n
        return pushed

    def compact(self, region_lo: int, region_hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Evacuate physical ``[region_lo, region_hi)`` into holes; rebinds the tables and
        removes the region from the stack. Returns ``(src, dst)`` pairs (``-1`` padded) whose
        bytes the caller must copy next, in stream order. The pairs are views of a buffer
        owned by this space: valid until the next ``compact``."""
        k = region_hi - region_lo
        if k > self.free:
            raise RuntimeError(f"{self.name}: compacting {k} units with {self.free} free")
        src, dst = self._moves[0, :k], self._moves[1, :k]
        uk.compact_band(
            self.v2p, self.p2v, self.free_stack, self.free, region_lo, region_hi, src, dst
        )
        self.free -= k
        return src, dst


def warm_up_id_kernels(
    device: torch.device, page_sizes: tuple[int, ...], req_dtype: torch.dtype
) -> None:
    """Compile every variant of the id ops (:meth:`IdSpace.bind` / :meth:`IdSpace.unbind`
    with and without the request table, :meth:`IdSpace.compact`, the int32 state-slot
    lookup ``translate_slots``) for ``page_sizes`` before the first step, on a throwaway
    space and request table of ``req_dtype``. Without it the first SWA retirement or
    compaction compiles mid-run, inside a step of the serving loop. The kernels do not
    specialise on counts, strides or id-list alignment (``unimem_kernel.id_ops``), so these
    variants are the ones the pools launch. No-op off CUDA (the references run there)."""
    if device.type != "cuda":
        return
    space = IdSpace("warm-up", 4, 4, device)
    space.push_range(0, 4)
    req = torch.full((2, 2 * max(page_sizes)), -1, dtype=req_dtype, device=device)
    vid = torch.ones(1, dtype=torch.int32, device=device)
    at = torch.zeros(1, dtype=torch.int32, device=device)  # row 0, page column 0
    table = {"req_to_token": req, "unit_rows": at, "unit_cols": at}
    for page_size in page_sizes:
        space.bind(vid, page_size=page_size)
        space.unbind(1, vids=vid, page_size=page_size)
        space.bind(vid, page_size=page_size, **table)
        space.unbind(1, page_size=page_size, **table)
    space.compact(2, 4)
    uk.translate_slots(vid, space.v2p, torch.empty_like(vid))  # the state slots' lookup
