"""``python -m unimem.launch_server``: the HTTP server, with SGLang's flags (replace ``sglang``
by ``unimem`` in a launch command). See :mod:`unimem.serve.server` and ``docs/serving.md``."""

from __future__ import annotations

import sys

from unimem.serve.server import main

if __name__ == "__main__":
    sys.exit(main())
