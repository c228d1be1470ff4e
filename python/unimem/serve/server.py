"""Start-up and shutdown of ``python -m unimem.launch_server``.

Order: parse the flags (one-line errors, exit 2), bind the listening socket (a port in use is
a one-line error before the model loads), build the engine exactly as :class:`unimem.Engine`
does (checkpoint, pools sized as SGLang sizes them, ``EngineCore``), log one capacity line
like SGLang's, start the engine thread, serve with uvicorn until SIGINT / SIGTERM, then drain
(new and queued requests get 503 JSON with ``Retry-After``; running ones get
``--graceful-shutdown-timeout`` seconds to finish, then are aborted: every open stream ends
with a final chunk and ``[DONE]``), stop the engine thread and exit 0; a second signal stops
at once. Ctrl-C at any point exits without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from dataclasses import asdict

from unimem.engine.args import EngineArgs
from unimem.memory.spec import LayerKind
from unimem.serve.args import CliError, ServerOptions, parse_args

__all__ = ["capacity_line", "main"]

log = logging.getLogger("unimem.serve")

PROG = "unimem.launch_server"
CLOSE_CONNECTIONS_S = 5
"""Seconds uvicorn gives open connections to close once the drain is over (their responses
have all ended by then; this only bounds a client that does not read)."""


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def capacity_line(engine) -> str:
    """SGLang's start-up summary: ``max_total_num_tokens=…, max_running_requests=…,
    context_len=…`` and the memory (the unified arena's bytes, or the static pools' units and
    bytes)."""
    pool = engine.pool
    gib = pool.stats.capacity_bytes / 2**30
    if engine.args.enable_unified_memory:
        memory = f"unified arena {gib:.3f} GiB"
    else:
        caps = getattr(pool, "capacity", {})
        unit = {LayerKind.FULL: "pages", LayerKind.SWA: "pages", LayerKind.STATE: "slots"}
        parts = ", ".join(f"{k.name} {n} {unit[k]}" for k, n in caps.items())
        memory = f"static pools {gib:.3f} GiB ({parts})"
    return (
        f"max_total_num_tokens={engine.max_total_num_tokens}, "
        f"max_running_requests={engine.max_running_requests}, "
        f"context_len={engine.context_length}, page_size={pool.page_size}, {memory}, "
        f"attention_backend={engine.backend_name}, cuda_graphs={engine.cuda_graphs}"
    )


def _build_engine(args: EngineArgs):
    from unimem.engine.api import Engine

    return Engine(**asdict(args))


def _uvicorn_server(config, drain=None):
    """A ``uvicorn.Server`` that stops gracefully on SIGINT / SIGTERM and then returns (uvicorn
    re-raises the signal after its shutdown, which would kill the process with it).
    ``drain``: a coroutine function run on the first signal before uvicorn stops (the
    server keeps answering meanwhile); a second signal stops at once."""
    import uvicorn

    class Server(uvicorn.Server):
        _loop: asyncio.AbstractEventLoop | None = None
        _drain_task: asyncio.Task | None = None

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

        def handle_exit(self, sig, frame):
            if drain is None or self._loop is None or self._drain_task is not None:
                self.force_exit = self.should_exit or self._drain_task is not None
                self.should_exit = True
                return
            self._drain_task = True  # claimed; the task replaces it on the loop
            self._loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self):
            self._drain_task = self._loop.create_task(self._drain())

        async def _drain(self):
            try:
                await drain()
            except Exception:
                log.exception("draining failed")
            finally:
                self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def serve(engine, options: ServerOptions, sock: socket.socket) -> None:
    """Run the HTTP server over ``engine`` on ``sock`` until a signal stops it."""
    import uvicorn

    from unimem.serve.app import make_app

    app = make_app(engine, options)
    config = uvicorn.Config(
        app,
        log_level=options.log_level,
        access_log=options.log_level == "debug",
        timeout_graceful_shutdown=CLOSE_CONNECTIONS_S,
    )
    serving = app.state.serving

    async def drain() -> None:
        log.info(
            "shutting down: new requests get 503; running ones have %gs to finish",
            options.graceful_shutdown_timeout,
        )
        await serving.drain(options.graceful_shutdown_timeout)

    server = _uvicorn_server(config, drain)
    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d", options.served_model_name, host, port)
    server.run(sockets=[sock])  # the app's shutdown stops the engine thread


def main(argv: list[str] | None = None) -> int:
    """The launcher; returns the exit status: 0 after a signal stopped the server, 2 for any
    command-line or start-up error, 130 when interrupted before serving."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _follower_node(args: EngineArgs) -> int:
    """A node other than 0 of a multi-node launch: no HTTP server; its tensor-parallel ranks
    follow rank 0 (on node 0, which serves) until it shuts down."""
    topo = args.topology()
    last = topo.first_rank + topo.local_size - 1
    log.info(
        "node %d of %d: ranks %d..%d following rank 0 at %s",
        topo.node_rank,
        topo.nnodes,
        topo.first_rank,
        last,
        topo.dist_init_addr,
    )
    try:
        _build_engine(args)
    except (ValueError, OSError, RuntimeError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    log.info("node %d: rank 0 shut down", topo.node_rank)
    return 0


def _main(argv: list[str] | None) -> int:
    try:
        engine_args, options = parse_args(argv)
    except CliError as e:
        return _fail(str(e))
    logging.basicConfig(
        level=options.log_level.upper(),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    if engine_args.node_rank > 0:
        return _follower_node(engine_args)
    if options.dp_size > 1:
        from unimem.serve import data_parallel

        argv = list(sys.argv[1:] if argv is None else argv)
        return data_parallel.run(argv, engine_args, options, options.dp_size, options.router_policy)
    try:
        sock = _bind(options.host, options.port)
    except OSError as e:
        return _fail(f"cannot listen on {options.host}:{options.port}: {e.strerror or e}")
    try:
        engine = _build_engine(engine_args)
    except (ValueError, OSError) as e:
        sock.close()
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    log.info(capacity_line(engine))
    if not options.skip_server_warmup:
        try:
            done = engine.warm_up()
        except Exception as e:  # a server that cannot run a step must not start serving
            log.exception("warm-up failed")
            engine.shutdown()
            sock.close()
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            return _fail(f"warm-up failed: {first}")
        log.info(
            "warm-up: %d requests, %d tokens in %.1f s", done["requests"], done["tokens"],
            done["seconds"],
        )  # fmt: skip
        engine.startup_seconds["warm_up"] = round(done["seconds"], 3)
    from unimem.engine.api import startup_line

    log.info(startup_line(engine.startup_seconds))
    serve(engine, options, sock)
    return 0
