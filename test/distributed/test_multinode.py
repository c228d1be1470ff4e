"""Tensor parallel 2 as two "nodes" on this machine (gloo, float32): node 0 is
``unimem.Engine(tp_size=2, nnodes=2, node_rank=0, dist_init_addr=127.0.0.1:PORT)`` in this
process, node 1 a separate ``python -m unimem.launch_server --node-rank 1`` with the same
flags (no HTTP: its rank follows rank 0) — the ranks meet at rank 0's store. Outputs equal
the unsharded engine's, on static pools and on a unified arena small enough to compact,
with the ranks' allocator states compared after every step (``UNIMEM_TP_CHECK_STATE=1``);
a start-up failure on node 1 reaches node 0 through the error exchange; ``validate`` runs
as two nodes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tiny_qwen3_next
import tiny_tokenizer
import tp_checks

import unimem
from unimem.engine.distributed import CHECK_ENV, Topology, free_port
from unimem.validate.protocol import ValidateConfig, validate

OUT = tp_checks.OUT
BASE = dict(device="cpu", dtype="float32", page_size=4, disable_radix_cache=True)
STATIC = dict(max_total_tokens=1024, max_running_requests=6)
UNIFIED = dict(enable_unified_memory=True, max_total_tokens=64, max_running_requests=3)


def _flags(kwargs: dict) -> list[str]:
    out = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, str(v)]
    return out


def _env() -> dict:
    return {**os.environ, CHECK_ENV: "1", "UNIMEM_TP_TIMEOUT_S": "120", "OMP_NUM_THREADS": "1"}


def _node1_server(path, kwargs: dict, addr: str, tmp_path) -> tuple[subprocess.Popen, object]:
    cmd = [sys.executable, "-m", "unimem.launch_server", "--model-path", str(path)]
    cmd += _flags({**kwargs, "tp_size": 2, "nnodes": 2, "node_rank": 1, "dist_init_addr": addr})
    log = tmp_path / "node1.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())
    return proc, log


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_nodes")
    hf = tiny_qwen3_next.build(path)
    tiny_tokenizer.save(path, hf.config.vocab_size)
    prompts = tp_checks.prompts(500)
    params = {"max_new_tokens": OUT, "ignore_eos": True}
    with unimem.Engine(model_path=str(path), **BASE, **STATIC) as ref:
        want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=params)]
    return path, prompts, params, want


@pytest.mark.parametrize("memory", ["unified", pytest.param("static", marks=pytest.mark.slow)])
def test_two_nodes_equal_one_process(model, memory, tmp_path, monkeypatch):
    path, prompts, params, want = model
    kwargs = {**BASE, **(UNIFIED if memory == "unified" else STATIC)}
    addr = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv(CHECK_ENV, "1")
    node1, log = _node1_server(path, kwargs, addr, tmp_path)
    try:
        engine = unimem.Engine(
            model_path=str(path), **kwargs, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr
        )
        try:
            assert engine._ranks.procs == []  # one rank per node: nothing spawned here
            got = engine.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in got] == want
            if memory == "unified":
                assert engine.pool.stats.compactions > 0
        finally:
            engine.shutdown()
        assert node1.wait(timeout=60) == 0, log.read_text()  # it returns when rank 0 stops
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.slow
def test_a_failure_on_node_1_reaches_node_0(model, tmp_path):
    path, *_ = model
    addr = f"127.0.0.1:{free_port()}"
    # node 1's copy of the checkpoint is missing: its load fails
    node1, log = _node1_server(tmp_path / "missing", {**BASE, **STATIC}, addr, tmp_path)
    try:
        with pytest.raises(ValueError, match="tensor-parallel rank 1 failed"):
            unimem.Engine(
                model_path=str(path),
                **BASE,
                **STATIC,
                tp_size=2,
                nnodes=2,
                node_rank=0,
                dist_init_addr=addr,
            )
        assert node1.wait(timeout=60) != 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.slow
def test_validate_as_two_nodes(tmp_path, monkeypatch):
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--tp-size", "2", "--requests", "8", "--input-len", "40", "--output-len", "16"]
    flags += ["--arena-mb", "0.4", "--max-running", "4", "--page-size", "4"]
    cmd = [sys.executable, "-m", "unimem", "validate", *flags]
    cmd += ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr]
    node1 = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    monkeypatch.setenv(CHECK_ENV, "1")
    cfg = ValidateConfig(
        tp_size=2,
        nnodes=2,
        node_rank=0,
        dist_init_addr=addr,
        requests=8,
        input_len=40,
        output_len=16,
        arena_mb=0.4,
        max_running=4,
        page_size=4,
    )
    try:
        report = validate(cfg)
        out, _ = node1.communicate(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert node1.returncode == 0, out.decode()
    assert b"node 1: ranks done" in out
    assert report["exact_match"] == 8 and report["unified"]["compactions"] > 0


def test_topology_is_checked():
    assert Topology(4, 2, 1, "10.0.0.1:29500").first_rank == 2
    with pytest.raises(ValueError, match="multiple of nnodes"):
        Topology(3, 2, 0, "h:1")
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        Topology(2, 2, 0)
    with pytest.raises(ValueError, match="node_rank"):
        Topology(2, 2, 2, "h:1")
    with pytest.raises(ValueError, match="HOST:PORT"):
        unimem.Engine(model_path="/nowhere", tp_size=2, nnodes=2, dist_init_addr="nohost")
