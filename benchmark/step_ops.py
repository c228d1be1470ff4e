"""The torch ops a verify step still launches outside our kernels, by unimem launch site, on
the CPU (no GPU needed).

Runs one eager DSPARK verify step of a preset (float32, torch reference attention) with the
GPU's dispatch — our Triton kernels selected (``UNIMEM_KERNEL_BACKEND=triton``, through the
interpreter) — under a ``TorchDispatchMode``, and lists every aten op with the two innermost
``unimem`` frames that issued it. Ops issued inside ``unimem_kernel`` (a Triton launch each
on a GPU) and inside the torch attention backend (FA4 on a GPU) are left out, as are views
(no kernel): what remains is, op for op, the small torch kernels a GPU step records in its
CUDA graph — the list to fuse from. Counts and element counts, not times (the profile on a GPU,
``profile_step.py``, gives those).

    python benchmark/step_ops.py --preset gpu_test --requests 4
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import traceback

os.environ.setdefault("UNIMEM_KERNEL_BACKEND", "triton")  # the GPU's choice of kernels
os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from unimem.attention.torch_backend import TorchReferenceBackend  # noqa: E402
from unimem.engine.core import EngineCore  # noqa: E402
from unimem.memory.static import StaticMemory  # noqa: E402
from unimem.models.config import memory_spec  # noqa: E402
from unimem.models.presets import preset  # noqa: E402
from unimem.models.synthetic import HybridModel  # noqa: E402
from unimem.speculative.chain import DsparkChain  # noqa: E402
from unimem.speculative.control import AcceptanceControl  # noqa: E402
from unimem.speculative.drafter import (
    DsparkDrafter,  # noqa: E402
    draft_config_for,  # noqa: E402
)

VIEWS = ("aten.view", "aten._unsafe_view", "aten.t.", "aten.slice", "aten.select",
         "aten.unsqueeze", "aten.squeeze", "aten.expand", "aten.as_strided", "aten.detach",
         "aten.alias", "aten.permute", "aten.transpose", "aten.split", "aten.unbind",
         "aten.reshape", "aten.unflatten", "aten.chunk")  # fmt: skip
SKIP_FILES = ("unimem_kernel/", "attention/torch_backend.py")


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.elems: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith(VIEWS):
            return out
        stack = traceback.extract_stack()
        if any(skip in f.filename for f in stack for skip in SKIP_FILES):
            return out
        sites = [f"{f.filename.split('unimem/')[-1]}:{f.lineno}({f.name})"
                 for f in stack if "/unimem/" in f.filename][-2:]  # fmt: skip
        key = (name, " < ".join(reversed(sites)))
        self.calls[key] += 1
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.elems[key] += first.numel() if isinstance(first, torch.Tensor) else 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpu_test")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    cfg = dataclasses.replace(preset(args.preset), dtype=torch.float32)
    model = HybridModel(cfg, seed=0)
    drafter = DsparkDrafter(draft_config_for(cfg), model.embed_weight, model.lm_head_weight, 17)
    n, length, gamma, ps = args.requests, args.input_len, args.gamma, args.page_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (n, length), generator=gen).tolist()
    refs = {i: p + p for i, p in enumerate(prompts)}
    chain = DsparkChain(drafter, gamma, AcceptanceControl(0.8, 0, refs, torch.device("cpu")))
    spec = memory_spec(cfg, ps, drafter.config.lanes())
    pages = n * -(-(length + 64 + 2 * (gamma + 1)) // ps)
    pool = StaticMemory(spec, pages, pages, n, n, cfg.max_context, torch.device("cpu"))
    eng = EngineCore(model, pool, TorchReferenceBackend(), n, 8192, chain=chain)
    for p in prompts:
        eng.submit(p, 64)
    while any(r.kv_len < length for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    log = _OpLog()
    with torch.inference_mode(), log:
        eng.runner._uniform_step(n)
    print(f"{args.preset} preset (float32 on CPU), {n} requests verifying, gamma {gamma}")
    print(f"{'calls':>5} {'elements':>10}  {'op':<30} launch site")
    for (op, site), c in sorted(log.calls.items(), key=lambda kv: kv[0][1]):
        print(f"{c:5d} {log.elems[(op, site)]:10d}  {op:<30} {site}")
    print(f"torch ops that launch a kernel: {sum(log.calls.values())}")


if __name__ == "__main__":
    main()
