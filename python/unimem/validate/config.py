"""What one run of the validation protocol is asked to do: :class:`ValidateConfig` (the
``python -m unimem validate`` / ``bench`` flags as fields, checked at construction: a bad
value is a ``ValueError`` naming the field and its flag) and :func:`bench_config`, the
``bench`` defaults at serving sizes. The protocol itself is :mod:`unimem.validate.protocol`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from unimem.engine.distributed import Topology
from unimem.engine.sampling import SamplingOptions
from unimem.models.loader import load_hf_config, resolve_dtype
from unimem.models.model_path import resolve_model_path
from unimem.models.presets import preset
from unimem.speculative.chain import VERIFY_LENGTHS

MB = 1 << 20


@dataclass
class ValidateConfig:
    device: str = "cpu"
    preset: str = "tiny"
    requests: int = 16
    input_len: int = 96
    output_len: int = 32
    seed: int = 0
    page_size: int = 16
    arena_mb: float | None = None
    max_running: int = 8
    chunk_size: int = 128
    backend: str = "auto"
    cuda_graphs: str = "auto"
    spec: str = "none"
    gamma: int = 7
    accept_rate: float = 0.8
    control_reference: str = "decode"
    repeats: int = 1
    prefix_cache: bool = False
    shared_prefix_len: int = 0
    checkpoint_interval: int = 1
    model_path: str | None = None
    dtype: str = "auto"
    prompts_file: str | None = None
    oracle: str = "none"
    speculative_draft_model_path: str | None = None
    draft_layers: int = 2
    temperature: float = 0.0
    top_p: float = 1.0
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    verify_lengths: str = "fixed"
    verify_budget: int | None = None
    deterministic: str = "auto"
    quantization: str | None = None

    def topology(self) -> Topology:
        """The nodes the ``tp_size`` ranks run on (``--nnodes``, ``--node-rank``,
        ``--dist-init-addr``)."""
        return Topology(self.tp_size, self.nnodes, self.node_rank, self.dist_init_addr)

    def __post_init__(self) -> None:
        if self.deterministic not in DETERMINISTIC_MODES:
            raise ValueError(
                f"deterministic must be one of {DETERMINISTIC_MODES}, got {self.deterministic!r}"
            )
        if self.deterministic == "on" and self.device != "cuda":
            raise ValueError(
                "--enable-deterministic-inference applies to --device cuda (CPU runs use "
                "torch's own kernels; float64 runs are exact already)"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or unset, got {self.quantization!r}")
        for name in ("requests", "input_len", "output_len", "page_size", "max_running", "tp_size"):
            _check_count(name, getattr(self, name))
        self.topology()
        _check_count("chunk_size", self.chunk_size)
        if self.arena_mb is not None and not (
            isinstance(self.arena_mb, (int, float))
            and math.isfinite(self.arena_mb)
            and self.arena_mb > 0
        ):
            raise ValueError(
                f"arena_mb (--arena-mb) must be a finite number > 0, got {self.arena_mb!r}"
            )
        if self.oracle not in ORACLES:
            raise ValueError(f"oracle must be one of {ORACLES}, got {self.oracle!r}")
        if self.oracle != "none" and self.model_path is None:
            raise ValueError("--oracle transformers needs --model-path (a HuggingFace checkpoint)")
        if self.prompts_file is not None and self.model_path is None:
            raise ValueError("--prompts needs --model-path (its tokenizer encodes them)")
        if self.model_path is not None and not os.path.isfile(
            os.path.join(self.checkpoint_dir, "config.json")
        ):
            raise ValueError(f"--model-path {self.model_path}: no config.json there")
        if (
            self.prompts_file is not None
            and self.prompts_file != PACKAGE_PROMPTS
            and not os.path.isfile(self.prompts_file)
        ):
            raise ValueError(
                f"--prompts {self.prompts_file}: no such file (or {PACKAGE_PROMPTS!r}: the "
                "package's real prompts)"
            )
        if not 0 <= self.shared_prefix_len <= self.input_len:
            raise ValueError(
                f"shared prefix length must be in [0, input length {self.input_len}], "
                f"got {self.shared_prefix_len}"
            )
        if not isinstance(self.checkpoint_interval, int) or self.checkpoint_interval < 1:
            raise ValueError(
                f"checkpoint interval must be an int >= 1, got {self.checkpoint_interval!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.attention_backend == "fa4" and self.device != "cuda":
            raise ValueError("the fa4 backend needs --device cuda")
        if self.use_cuda_graphs and self.attention_backend == "torch":
            raise ValueError(
                "CUDA graphs need the fa4 backend on a CUDA device (the torch reference "
                "backend reads lengths on the host)"
            )
        if self.spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {SPEC_MODES}, got {self.spec!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {self.repeats!r}")
        if self.control_reference not in CONTROL_REFERENCES:
            raise ValueError(
                f"control reference must be one of {CONTROL_REFERENCES}, "
                f"got {self.control_reference!r}"
            )
        if self.spec != "none":
            if not isinstance(self.gamma, int) or self.gamma < 1:
                raise ValueError(f"gamma must be an int >= 1, got {self.gamma!r}")
            if not 0.0 <= self.accept_rate <= 1.0:
                raise ValueError(f"accept rate must be in [0, 1], got {self.accept_rate!r}")
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0
        ):
            raise ValueError(f"temperature (--temperature) must be >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p (--top-p) must be in (0, 1], got {self.top_p!r}")
        if self.temperature > 0 and self.oracle != "none":
            raise ValueError("--oracle compares greedy outputs: it needs --temperature 0")
        if self.verify_lengths not in VERIFY_LENGTHS:
            raise ValueError(
                f"verify lengths (--verify-lengths) must be one of {VERIFY_LENGTHS}, "
                f"got {self.verify_lengths!r}"
            )
        b = self.verify_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(
                f"verify budget (--speculative-verify-budget) must be an int >= 1, got {b!r}"
            )
        _check_count("draft_layers", self.draft_layers)
        if self.speculative_draft_model_path is not None and self.draft_layers != 2:
            raise ValueError(
                "--draft-layers applies to the seeded drafter, not to "
                "--speculative-draft-model-path (its config.json gives its layers)"
            )
        draft = self.speculative_draft_model_path  # used with spec dspark only
        if draft is not None and not os.path.isfile(os.path.join(draft, "config.json")):
            raise ValueError(f"--speculative-draft-model-path {draft}: no config.json there")

    def sampling(self) -> SamplingOptions | None:
        """Every request's sampling options: None (greedy) at temperature 0, else
        ``temperature`` and ``top_p`` with the engine's per-request seed (drawn from its
        ``random_seed`` and the request id: the same in every run of the protocol)."""
        if self.temperature == 0:
            return None
        return SamplingOptions(temperature=self.temperature, top_p=self.top_p)

    @property
    def window(self) -> int:
        """Tokens a request's write window reaches past its last token (``gamma`` with
        speculation, else 0)."""
        return self.gamma if self.spec != "none" else 0

    @property
    def lookahead(self) -> int:
        """Tokens of memory a request keeps for a verify step launched after its last one
        (results are read one step late): ``gamma + 1`` with speculation, else 0."""
        return self.gamma + 1 if self.spec != "none" else 0

    @property
    def attention_backend(self) -> str:
        """The backend ``auto`` resolves to: FA4 on CUDA for a 16-bit preset, else the torch
        reference (float64 presets are for exactness, which FA4 does not compute in)."""
        if self.backend != "auto":
            return self.backend
        sixteen_bit = self.model_dtype in (torch.bfloat16, torch.float16)
        return "fa4" if self.device == "cuda" and sixteen_bit else "torch"

    @property
    def checkpoint_dir(self) -> str | None:
        """The checkpoint directory ``model_path`` names (a GGUF file or an embedded model's
        name resolved, :func:`unimem.models.model_path.resolve_model_path`); None for a
        preset."""
        if self.model_path is None:
            return None
        return resolve_model_path(self.model_path)

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model computes in: the preset's, or the checkpoint's resolved from
        ``dtype`` (:func:`unimem.models.loader.resolve_dtype`)."""
        if self.model_path is None:
            return preset(self.preset).dtype
        hf_config = load_hf_config(self.checkpoint_dir)
        return resolve_dtype(self.dtype, hf_config, torch.device(self.device))

    @property
    def use_deterministic(self) -> bool:
        """Batch-invariant kernels (:mod:`unimem.models.batch_invariant`): "auto" turns them
        on with CUDA."""
        if self.deterministic == "auto":
            return self.device == "cuda"
        return self.deterministic == "on"

    @property
    def use_cuda_graphs(self) -> bool:
        if self.cuda_graphs == "auto":
            return self.device == "cuda" and self.attention_backend == "fa4"
        if self.cuda_graphs == "on" and self.device != "cuda":
            raise ValueError("CUDA graphs need --device cuda")
        return self.cuda_graphs == "on"


def _check_count(name: str, value: object) -> None:
    """``ValueError`` naming the field (and its flag) unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{name} ({flag}) must be an int >= 1, got {value!r}")


SPEC_MODES = ("none", "dspark")


DETERMINISTIC_MODES = ("auto", "on", "off")


ORACLES = ("none", "transformers")


CONTROL_REFERENCES = ("decode", "speculative")


BACKENDS = ("auto", "torch", "fa4")


BENCH_MODEL = "gemma-3-270m"
"""What ``python -m unimem bench`` runs without ``--preset`` or ``--model-path``: the embedded
real model (the ``model`` extra), with its shipped drafter, on :data:`PACKAGE_PROMPTS`, the
acceptance control off."""

PACKAGE_PROMPTS = "short"
"""``--prompts`` value naming the package's short real prompts
(:func:`unimem.data.prompts.short_prompts`) instead of a file."""


def bench_config(**overrides) -> ValidateConfig:
    """The ``bench`` protocol's defaults for a synthetic preset: serving sizes on one GPU —
    the ``small`` preset, 48 requests of 512 prompt and 2048 output tokens, all running at
    once, DSPARK gamma 7 with acceptance control 0.8 following a speculative reference run,
    page size 64, FA4 and CUDA graphs; static and unified each run twice (ABBA order). The
    command line runs :data:`BENCH_MODEL` instead unless ``--preset`` or ``--model-path`` is
    given (``unimem.__main__``), with the acceptance control off on a checkpoint."""
    base = dict(
        device="cuda",
        preset="small",
        requests=48,
        input_len=512,
        output_len=2048,
        page_size=64,
        max_running=48,
        chunk_size=8192,
        spec="dspark",
        gamma=7,
        accept_rate=0.8,
        control_reference="speculative",
        repeats=2,
    )
    base.update(overrides)
    return ValidateConfig(**base)
