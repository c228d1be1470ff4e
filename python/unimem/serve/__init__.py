"""The HTTP server: ``python -m unimem.launch_server`` with SGLang's flags, an OpenAI-compatible
API and SGLang's native routes around one :class:`unimem.Engine`.

Modules, one job each: :mod:`~unimem.serve.args` (the command line),
:mod:`~unimem.serve.protocol` (request bodies and error bodies),
:mod:`~unimem.serve.detokenize` (incremental detokenization and stop strings),
:mod:`~unimem.serve.engine_loop` (the step-loop thread and its queues),
:mod:`~unimem.serve.generation` (one request from the HTTP side),
:mod:`~unimem.serve.metrics` (Prometheus metrics), :mod:`~unimem.serve.app` (the routes) and
:mod:`~unimem.serve.server` (start-up and shutdown).
"""
