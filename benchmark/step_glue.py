"""The torch ops one eager decode or verify step runs outside ``unimem_kernel``, by call site.

A CUDA-graph step replays every kernel it recorded; the small torch ops around the model
(casts, ``where``, index writes, copies, concatenations) each cost a launch of ~1.5–2 µs there
however little they do. ``benchmark/profile_step.py`` counts the launches per kernel name;
this script says where they come from: it builds an engine (static pools, DSPARK with the
acceptance control, as ``profile_step.py`` does), runs its prefill and a few steps, then runs
one eager step of the running batch under a ``TorchDispatchMode`` that records every aten op
with the innermost ``unimem`` frames of the Python stack that called it. Ops called from
``unimem_kernel`` (the kernels' torch references, where they run) or from the CPU-only torch
attention backend are left out unless ``--with-kernels``; views, ``empty`` and GEMMs always.

On CUDA the step runs as the engine runs it (FA4 when installed). On CPU the model's fused
ops would take their torch references, some of them outside ``unimem_kernel``; to see the GPU
path's glue on CPU, force the Triton kernels through the interpreter (a few minutes at the
``gpu_test`` preset):

    UNIMEM_KERNEL_BACKEND=triton TRITON_INTERPRET=1 python benchmark/step_glue.py

Sites are printed as ``file:line(function)``, innermost first. The seventeenth session's
list (``docs/benchmarks.md``, profile section) came from this trace.
"""

from __future__ import annotations

import argparse
import traceback
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unimem.engine.core import EngineCore
from unimem.memory.static import StaticMemory
from unimem.models.config import memory_spec
from unimem.models.presets import preset, preset_names
from unimem.models.synthetic import HybridModel
from unimem.speculative.chain import DsparkChain
from unimem.speculative.control import AcceptanceControl
from unimem.speculative.drafter import DsparkDrafter, draft_config_for

# ops that launch nothing (views, allocation, metadata) or that are the model's GEMMs
_SKIP = {
    "_reshape_alias", "_unsafe_view", "alias", "as_strided", "detach", "dim", "empty",
    "empty_like", "empty_strided", "expand", "is_nonzero", "lift_fresh", "narrow", "new_empty",
    "permute", "reshape", "select", "size", "slice", "split", "split_with_sizes", "squeeze",
    "stride", "sym_numel", "sym_size", "sym_storage_offset", "sym_stride", "t", "transpose",
    "unbind", "unflatten", "unsqueeze", "view",
    "addmm", "bmm", "mm", "_grouped_mm", "_scaled_mm",
}  # fmt: skip


class _Recorder(TorchDispatchMode):
    """Counts aten ops by ``(a kernel's own, op, call site)``."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.counts: dict[tuple[bool, str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _SKIP:
            frames = [f for f in traceback.extract_stack()[:-1] if "/unimem" in f.filename]
            frames.reverse()
            kernel = bool(frames) and (
                "unimem_kernel" in frames[0].filename
                or any("attention/torch_backend.py" in f.filename for f in frames)
            )
            site = " < ".join(
                f"{f.filename.split('python/', 1)[-1]}:{f.lineno}({f.name})"
                for f in frames[: self.depth]
            )
            self.counts[(kernel, name, site)] += 1
        return func(*args, **(kwargs or {}))


def _backend(device: torch.device):
    if device.type == "cuda":
        try:
            from unimem.attention.fa4_backend import FA4Backend

            return FA4Backend()
        except ImportError:
            pass
    from unimem.attention.torch_backend import TorchReferenceBackend

    return TorchReferenceBackend()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpu_test", choices=preset_names())
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=40)
    ap.add_argument("--gamma", type=int, default=7, help="0: decode steps (no DSPARK)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--depth", type=int, default=3, help="unimem frames per call site")
    ap.add_argument(
        "--with-kernels",
        action="store_true",
        help="also list the ops of unimem_kernel's references and the torch attention backend",
    )
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset(args.preset)
    model = HybridModel(cfg, seed=0, device=dev)
    n, length = args.requests, args.input_len
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (n, length), generator=gen).tolist()
    chain, lanes = None, ()
    if args.gamma > 0:
        drafter = DsparkDrafter(draft_config_for(cfg), model.embed_weight, model.lm_head_weight,
                                seed=17)  # fmt: skip
        refs = {i: p + p for i, p in enumerate(prompts)}
        chain = DsparkChain(drafter, args.gamma, AcceptanceControl(0.8, 0, refs, dev))
        lanes = drafter.config.lanes()
    spec = memory_spec(cfg, args.page_size, lanes)
    out_len = 64
    pages = n * -(-(length + out_len + 2 * (args.gamma + 1)) // args.page_size)
    pool = StaticMemory(spec, pages, pages, n, n, cfg.max_context, dev)
    eng = EngineCore(model, pool, _backend(dev), n, 8192, chain=chain, cuda_graphs=False)
    for p in prompts:
        eng.submit(p, out_len)
    while any(r.kv_len < length for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(2):
        eng.step()
    width = len(eng.scheduler.running)
    eng.runner._uniform_step(width)  # first-use work outside the recording
    rec = _Recorder(args.depth)
    with rec:
        eng.runner._uniform_step(width)
    kind = "verify" if chain is not None else "decode"
    print(f"{cfg.dtype} {args.preset} on {dev}, one eager {kind} step of {width} lanes: "
          f"torch ops by call site (count, op, site)")  # fmt: skip
    total = 0
    for (kernel, op, site), count in sorted(rec.counts.items(), key=lambda kv: kv[0][2]):
        if kernel and not args.with_kernels:
            continue
        total += count
        print(f"{'K ' if kernel else '  '}{count:4d}  {op:<20} {site}")
    print(f"{total} ops listed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
