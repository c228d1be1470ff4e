"""Attention metadata for one step, built into capture-stable buffers.

``AttentionMetadata`` is what every attention layer of a step reads: query and key lengths,
their prefix sums, the physical FULL and SWA page tables, and where the step's new tokens are
written. ``MetadataBuilder`` owns one set of fixed-size device buffers (allocated once, at
construction) and fills them for a step by calling the ``unimem_kernel`` ops with explicit
tensors: the request table and the live ``v2p`` tables are *arguments*, never owned. The
builder knows nothing about pools and pools build no metadata.

Every tensor of a returned ``AttentionMetadata`` is a leading slice of an owned buffer, so its
address is the same on every call: a CUDA graph that records ``decode`` or ``verify`` and the
layers that read the result replays against the same memory and re-reads the live ``v2p``
tables each time.

Which call for which step:

- ``decode``: one new token per request (``q_len = 1``);
- ``verify``: ``gamma + 1`` new tokens per request (a DSPARK chain verify, causal);
- ``extend``: ragged prefill / extend / variable-length verify, ``extend_lens[b]`` new tokens
  after ``prefix_lens[b]`` cached ones;
- ``verify_ragged``: a packed ("compact") verify whose per-request lengths are device data
  (decided inside the step), padded to a fixed number of rows: capture safe.

``decode``, ``verify`` and ``verify_ragged`` allocate nothing and never read device memory on
the host (capture safe). ``extend`` reads nothing on the host either, but allocates small
temporaries for the ragged write window (a device gather): it is the eager path, not meant
for graph capture.

Token conventions shared with the backends: each request's queries are its last ``q_len``
tokens; query ``i`` of request ``b`` sits at position ``cache_seqlens[b] - q_len_b + i``. For
decode/verify, ``seq_lens`` counts the tokens already cached *before* the step, so
``cache_seqlens = seq_lens + q_len`` and the new tokens sit at ``seq_lens[b] + j``.

SWA. A builder made with ``swa=True`` also fills an SWA page table and SWA write slots. If a
call passes ``swa_v2p=None`` the SWA fields alias the FULL ones (SWA layers then use the FULL
physical ids: the static baseline, where page ids are used as they are).

One builder is one set of buffers: a step that needs two live metadata at once (for example a
draft and a target pass whose results are both read later) uses two builders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unimem_kernel.id_ops import translate_tokens
from unimem_kernel.metadata import build_decode_metadata, build_extend_metadata
from unimem_kernel.write_window import gather_ragged_write_window, gather_write_window

__all__ = ["AttentionMetadata", "MetadataBuffers", "MetadataBuilder"]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything an attention layer reads for one step. All device tensors are int32 unless
    stated; ``bs`` requests, ``num_tokens`` (``T``) new tokens in request order.

    - ``cu_seqlens_q [bs+1]``: exclusive prefix sum of new tokens per request;
    - ``cache_seqlens [bs]``: keys each request attends to (cached + new);
    - ``cu_seqlens_k [bs+1]``: exclusive prefix sum of ``cache_seqlens``;
    - ``page_table [bs, W]``: physical FULL pages; columns past a request's live page count
      hold the sink 0 (tail contract);
    - ``swa_page_table [bs, W]`` or None: physical SWA pages (retired pages read as the sink);
    - ``max_seqlen_q``, ``max_seqlen_k``: host ints, upper bounds of the per-request lengths;
    - ``full_write_slots [T]``, ``swa_write_slots [T]`` or None: physical token slots where new
      token ``t``'s K/V go (slot ``s`` = page ``s // page_size``, offset ``s % page_size``);
      slot 0 (the sink) marks a lane with nowhere to write;
    - ``positions [T]`` int64: position of new token ``t`` within its request;
    - ``uniform_q``: every request has exactly ``max_seqlen_q`` new tokens, request-major
      (``cu_seqlens_q = arange(bs + 1) * max_seqlen_q``): the decode and verify steps'
      metadata. Host-known; lets a backend take a kernel for fixed-width query blocks.
    """

    cu_seqlens_q: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    page_table: torch.Tensor
    swa_page_table: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    num_tokens: int
    page_size: int
    full_write_slots: torch.Tensor
    swa_write_slots: torch.Tensor | None
    positions: torch.Tensor
    uniform_q: bool = False

    @property
    def batch_size(self) -> int:
        return self.cache_seqlens.shape[0]

    def table(self, swa: bool) -> torch.Tensor:
        """The page table that FULL (``swa=False``) or SWA (``swa=True``) layers read."""
        if not swa:
            return self.page_table
        if self.swa_page_table is None:
            raise ValueError("this metadata has no SWA page table (builder made with swa=False)")
        return self.swa_page_table

    def write_slots(self, swa: bool) -> torch.Tensor:
        """Physical write slots of FULL (``swa=False``) or SWA (``swa=True``) layers."""
        if not swa:
            return self.full_write_slots
        if self.swa_write_slots is None:
            raise ValueError("this metadata has no SWA write slots (builder made with swa=False)")
        return self.swa_write_slots


@dataclass(frozen=True)
class MetadataBuffers:
    """The owned, fixed-size device buffers behind every ``AttentionMetadata`` of a builder."""

    cu_seqlens_q: torch.Tensor  # [max_bs + 1] int32
    cache_seqlens: torch.Tensor  # [max_bs] int32
    cu_seqlens_k: torch.Tensor  # [max_bs + 1] int32
    page_table: torch.Tensor  # [max_bs, max_pages_per_req] int32
    swa_page_table: torch.Tensor | None  # [max_bs, max_pages_per_req] int32
    full_write_slots: torch.Tensor  # [max_tokens] int32
    swa_write_slots: torch.Tensor | None  # [max_tokens] int32
    positions: torch.Tensor  # [max_tokens] int64
    arange: torch.Tensor  # [max_bs + 1] int32, 0..max_bs (static, for uniform cu_seqlens_q)

    @classmethod
    def allocate(
        cls,
        max_bs: int,
        max_pages_per_req: int,
        max_tokens: int,
        swa: bool,
        device: torch.device | str,
    ) -> MetadataBuffers:
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            cu_seqlens_q=torch.zeros(max_bs + 1, **i32),
            cache_seqlens=torch.zeros(max_bs, **i32),
            cu_seqlens_k=torch.zeros(max_bs + 1, **i32),
            page_table=torch.zeros(max_bs, max_pages_per_req, **i32),
            swa_page_table=torch.zeros(max_bs, max_pages_per_req, **i32) if swa else None,
            full_write_slots=torch.zeros(max_tokens, **i32),
            swa_write_slots=torch.zeros(max_tokens, **i32) if swa else None,
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            arange=torch.arange(max_bs + 1, **i32),
        )


class MetadataBuilder:
    """Fills capture-stable metadata buffers for decode, verify and extend steps.

    Sizes are fixed at construction: ``max_bs`` requests, ``max_pages_per_req`` page-table
    columns (a request longer than ``max_pages_per_req * page_size`` tokens is not
    representable), ``max_tokens`` new tokens per step. Inputs are int32 device tensors:
    ``req_to_token [R, ctx]`` (virtual token ids), ``req_pool_indices [bs]``, lengths ``[bs]``,
    ``full_v2p`` (None = identity) and ``swa_v2p`` (None = alias FULL, see module docstring).
    Each call overwrites the buffers; the returned metadata is valid until the next call.
    """

    def __init__(
        self,
        *,
        max_bs: int,
        max_pages_per_req: int,
        max_tokens: int,
        page_size: int,
        swa: bool,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("max_bs", max_bs),
            ("max_pages_per_req", max_pages_per_req),
            ("max_tokens", max_tokens),
            ("page_size", page_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MetadataBuilder.{name} must be a positive int, got {value!r}")
        self.max_bs = max_bs
        self.max_pages_per_req = max_pages_per_req
        self.max_tokens = max_tokens
        self.page_size = page_size
        self.swa = swa
        self.device = torch.device(device)
        self.buffers = MetadataBuffers.allocate(
            max_bs, max_pages_per_req, max_tokens, swa, self.device
        )

    @property
    def max_context(self) -> int:
        """Longest request (tokens) the page tables can describe."""
        return self.max_pages_per_req * self.page_size

    # ----------------------------------------------------------------------------- steps

    def decode(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        full_v2p: torch.Tensor | None,
        swa_v2p: torch.Tensor | None = None,
        *,
        max_seqlen_k: int | None = None,
    ) -> AttentionMetadata:
        """One new token per request at position ``seq_lens[b]``. Capture safe.

        ``max_seqlen_k`` (host int, optional): an upper bound of ``seq_lens + 1``; defaults to
        ``max_context`` (always valid, fixed for a captured graph).
        """
        return self._uniform(
            req_to_token, req_pool_indices, seq_lens, full_v2p, swa_v2p, 1, max_seqlen_k
        )

    def verify(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        full_v2p: torch.Tensor | None,
        swa_v2p: torch.Tensor | None = None,
        *,
        gamma: int,
        max_seqlen_k: int | None = None,
    ) -> AttentionMetadata:
        """``gamma + 1`` new tokens per request at ``seq_lens[b] .. seq_lens[b] + gamma``,
        attended causally. Capture safe (``cu_seqlens_q = arange * (gamma + 1)`` is written by
        one in-place device op from a static arange)."""
        if not isinstance(gamma, int) or gamma < 0:
            raise ValueError(f"gamma must be an int >= 0, got {gamma!r}")
        return self._uniform(
            req_to_token, req_pool_indices, seq_lens, full_v2p, swa_v2p, gamma + 1, max_seqlen_k
        )

    def extend(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        full_v2p: torch.Tensor | None,
        swa_v2p: torch.Tensor | None = None,
        *,
        num_tokens: int,
        max_seqlen_q: int,
        max_seqlen_k: int | None = None,
    ) -> AttentionMetadata:
        """Ragged step: request ``b`` adds ``extend_lens[b]`` tokens after ``prefix_lens[b]``.

        Host ints from the caller (who decided the lengths): ``num_tokens`` must equal
        ``sum(extend_lens)`` and ``max_seqlen_q >= max(extend_lens)``; ``max_seqlen_k`` bounds
        ``prefix + extend`` (default ``max_context``). These preconditions are not checked on
        the device (that would need a host read).

        Write slots: token ``i`` of request ``b`` goes to
        ``translate(req_to_token[req_pool_indices[b], prefix_lens[b] + i])`` through each
        space's ``v2p``. They are computed by a device gather (``searchsorted`` over
        ``cu_seqlens_q`` to find each token's request, then ``translate_tokens``), which
        allocates temporaries: eager only, no host read.
        """
        bs = self._check_batch(req_pool_indices, num_tokens)
        if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be an int >= 0, got {max_seqlen_q!r}")
        buf = self.buffers
        swa_table = buf.swa_page_table[:bs] if self.swa and swa_v2p is not None else None
        build_extend_metadata(
            req_to_token,
            req_pool_indices,
            prefix_lens,
            extend_lens,
            self.page_size,
            full_v2p,
            swa_v2p if swa_table is not None else None,
            buf.cu_seqlens_q[: bs + 1],
            buf.cache_seqlens[:bs],
            buf.cu_seqlens_k[: bs + 1],
            buf.page_table[:bs],
            swa_table,
        )
        full_slots = buf.full_write_slots[:num_tokens]
        positions = buf.positions[:num_tokens]
        swa_slots = buf.swa_write_slots[:num_tokens] if swa_table is not None else None
        if num_tokens > 0:
            self._ragged_write_window(
                req_to_token,
                req_pool_indices,
                prefix_lens,
                buf.cu_seqlens_q[: bs + 1],
                full_v2p,
                swa_v2p if swa_slots is not None else None,
                full_slots,
                swa_slots,
                positions,
            )
        return self._result(bs, num_tokens, max_seqlen_q, max_seqlen_k, swa_table, swa_slots)

    def verify_ragged(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        verify_lens: torch.Tensor,
        full_v2p: torch.Tensor | None,
        swa_v2p: torch.Tensor | None = None,
        *,
        num_tokens: int,
        max_seqlen_q: int,
        max_seqlen_k: int | None = None,
    ) -> AttentionMetadata:
        """Packed verify: request ``b`` verifies ``verify_lens[b]`` tokens (a device tensor)
        at ``seq_lens[b] ..``, packed back to back (``cu_seqlens_q``, computed on the device)
        in ``num_tokens`` fixed rows. Capture safe: the extend metadata kernel (lengths,
        prefix sums, page tables from the live ``v2p``) and one ragged write-window gather.

        Host ints: ``num_tokens >= sum(verify_lens)`` (rows past the sum are padding: write
        slot 0, the sink, and position 0; no request's queries), ``max_seqlen_q >=
        max(verify_lens)``; preconditions not checked on the device."""
        bs = self._check_batch(req_pool_indices, num_tokens)
        if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be an int >= 0, got {max_seqlen_q!r}")
        buf = self.buffers
        swa_table = buf.swa_page_table[:bs] if self.swa and swa_v2p is not None else None
        build_extend_metadata(
            req_to_token,
            req_pool_indices,
            seq_lens,
            verify_lens,
            self.page_size,
            full_v2p,
            swa_v2p if swa_table is not None else None,
            buf.cu_seqlens_q[: bs + 1],
            buf.cache_seqlens[:bs],
            buf.cu_seqlens_k[: bs + 1],
            buf.page_table[:bs],
            swa_table,
        )
        swa_slots = buf.swa_write_slots[:num_tokens] if swa_table is not None else None
        gather_ragged_write_window(
            req_to_token,
            req_pool_indices,
            seq_lens,
            buf.cu_seqlens_q[: bs + 1],
            self.page_size,
            full_v2p,
            swa_v2p if swa_slots is not None else None,
            buf.full_write_slots[:num_tokens],
            swa_slots,
            buf.positions[:num_tokens],
        )
        return self._result(bs, num_tokens, max_seqlen_q, max_seqlen_k, swa_table, swa_slots)

    # ----------------------------------------------------------------------------- internals

    def _check_batch(self, req_pool_indices: torch.Tensor, num_tokens: int) -> int:
        bs = req_pool_indices.numel()
        if bs > self.max_bs:
            raise ValueError(f"batch of {bs} requests exceeds max_bs={self.max_bs}")
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} new tokens exceed max_tokens={self.max_tokens}")
        return bs

    def _uniform(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        full_v2p: torch.Tensor | None,
        swa_v2p: torch.Tensor | None,
        q_len: int,
        max_seqlen_k: int | None,
    ) -> AttentionMetadata:
        bs = req_pool_indices.numel()
        num_tokens = bs * q_len
        self._check_batch(req_pool_indices, num_tokens)
        buf = self.buffers
        swa_table = buf.swa_page_table[:bs] if self.swa and swa_v2p is not None else None
        build_decode_metadata(
            req_to_token,
            req_pool_indices,
            seq_lens,
            q_len,
            self.page_size,
            full_v2p,
            swa_v2p if swa_table is not None else None,
            buf.cache_seqlens[:bs],
            buf.cu_seqlens_k[: bs + 1],
            buf.page_table[:bs],
            swa_table,
        )
        torch.mul(buf.arange[: bs + 1], q_len, out=buf.cu_seqlens_q[: bs + 1])
        swa_slots = buf.swa_write_slots[:num_tokens] if swa_table is not None else None
        gather_write_window(
            req_to_token,
            req_pool_indices,
            seq_lens,
            q_len,
            self.page_size,
            full_v2p,
            swa_v2p if swa_slots is not None else None,
            buf.full_write_slots[:num_tokens],
            swa_slots,
            buf.positions[:num_tokens],
        )
        return self._result(
            bs, num_tokens, q_len, max_seqlen_k, swa_table, swa_slots, uniform_q=True
        )

    def _ragged_write_window(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        full_v2p: torch.Tensor | None,
        swa_v2p: torch.Tensor | None,
        out_full: torch.Tensor,
        out_swa: torch.Tensor | None,
        out_positions: torch.Tensor,
    ) -> None:
        """Eager device gather of a ragged step's write slots (allocates temporaries)."""
        num_tokens = out_full.numel()
        dev = out_full.device
        bs = req_pool_indices.numel()
        tok = torch.arange(num_tokens, dtype=torch.int32, device=dev)
        # request of each new token: the number of prefix-sum ends <= tok
        b = torch.searchsorted(cu_seqlens_q[1 : bs + 1].contiguous(), tok, right=True)
        b = b.clamp_max(max(bs - 1, 0))
        offset = tok.long() - cu_seqlens_q.long()[b]
        pos = prefix_lens.long()[b] + offset
        out_positions.copy_(pos)
        rows, ctx = req_to_token.shape
        row = req_pool_indices.long()[b]
        ok = (pos >= 0) & (pos < ctx) & (row >= 0) & (row < rows)
        vtok = req_to_token[row.clamp(0, max(rows - 1, 0)), pos.clamp(0, max(ctx - 1, 0))]
        vtok = torch.where(ok, vtok, -1).to(torch.int32)
        self._translate(vtok, full_v2p, out_full)
        if out_swa is not None:
            self._translate(vtok, swa_v2p, out_swa)

    def _translate(self, vtok: torch.Tensor, v2p: torch.Tensor | None, out: torch.Tensor) -> None:
        if v2p is None:  # identity: the virtual slot is the physical slot; invalid -> sink 0
            out.copy_(torch.where(vtok >= 0, vtok, 0))
        else:
            translate_tokens(vtok, v2p, self.page_size, out)

    def _result(
        self,
        bs: int,
        num_tokens: int,
        max_seqlen_q: int,
        max_seqlen_k: int | None,
        swa_table: torch.Tensor | None,
        swa_slots: torch.Tensor | None,
        *,
        uniform_q: bool = False,
    ) -> AttentionMetadata:
        buf = self.buffers
        full_table = buf.page_table[:bs]
        full_slots = buf.full_write_slots[:num_tokens]
        if self.swa and swa_table is None:  # swa_v2p=None: SWA layers use the FULL ids
            swa_table, swa_slots = full_table, full_slots
        return AttentionMetadata(
            cu_seqlens_q=buf.cu_seqlens_q[: bs + 1],
            cache_seqlens=buf.cache_seqlens[:bs],
            cu_seqlens_k=buf.cu_seqlens_k[: bs + 1],
            page_table=full_table,
            swa_page_table=swa_table,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=self.max_context if max_seqlen_k is None else int(max_seqlen_k),
            num_tokens=num_tokens,
            page_size=self.page_size,
            full_write_slots=full_slots,
            swa_write_slots=swa_slots,
            positions=buf.positions[:num_tokens],
            uniform_q=uniform_q,
        )
