"""``python -m unimem.launch_server``: the HTTP server, with SGLang's flags (replace ``sglang``
by ``unimem`` in a launch command). See :mod:`unimem.serve.server` and ``docs/serving.md``."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    try:
        from unimem.serve.server import main
    except KeyboardInterrupt:  # Ctrl-C while the imports load
        print("unimem.launch_server: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
