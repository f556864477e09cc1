"""``python tests/shard_relay.py serve ...``: ``relay-server`` with the shard-lease routes installed.

Until relay_server/app.py wires :mod:`relay_server.shards_api` into its route table itself, the
lease tests start their relay through this launcher; once it does, ``install`` is a no-op and
this is exactly ``relay-server``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay_server import app as app_module  # noqa: E402
from relay_server import shards_api  # noqa: E402

_create_app = app_module.create_app


def create_app(*args, **kwargs):
    app = _create_app(*args, **kwargs)
    shards_api.install(app)
    return app


app_module.create_app = create_app
import relay_server.server as server_module  # noqa: E402

server_module.create_app = create_app

if __name__ == "__main__":
    from relay_server.cli import main

    sys.exit(main())
