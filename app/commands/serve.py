"""``embedpool serve``: the HTTP API (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os

from embedpool.app.commands.common import command
from embedpool.app.settings import Settings, add_stored_value_args, from_args


def register(sub) -> None:
    p = command(
        sub, "serve", run, help="run the HTTP API",
        description="Serve embeddings and collections over HTTP (docs at /docs). Every option is also "
                    "an EMBEDPOOL_* environment variable (e.g. EMBEDPOOL_API_KEY); flags win. Several models: "
                    "--model NAME=PATH_OR_ID, repeated (the first the default); requests pick one by `model`.",
        storage=True, several_models=True)
    p.add_argument("--host", help="address to bind (env EMBEDPOOL_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (env EMBEDPOOL_PORT, default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (env EMBEDPOOL_API_KEY; "
                                     "prefer the variable: flags show in ps)")
    p.add_argument("--pooler", help="default pooler spec (env EMBEDPOOL_POOLER, default auto)")
    p.add_argument("--replicas", type=int, metavar="N",
                   help="API servers sharing one Milvus server (env EMBEDPOOL_REPLICAS, default 1); above 1 their "
                        "reads are Strong unless --milvus-consistency says otherwise")
    p.add_argument("--max-client-batch", type=int, help="most inputs per request (413 above)")
    p.add_argument("--max-input-chars", type=int, help="longest input in characters (413 above)")
    p.add_argument("--max-payload-bytes", type=int, help="largest request body (413 above)")
    add_stored_value_args(p)
    p.add_argument("--max-queue", type=int, help="inputs waiting before 429")
    p.add_argument("--max-wait-ms", type=float,
                   help="longest wait to fill a batch (only after the model was idle, for clients of the previous round)")
    p.add_argument("--single-thread-tokens", type=int,
                   help="batcher rounds under this many tokens encode on one thread (0: always all threads)")
    p.add_argument("--shutdown-timeout", type=float,
                   help="seconds a stopping server lets the requests in flight finish (default 30)")
    p.add_argument("--allow-pooler-paths", action="store_true", default=None,
                   help="let requests load pooler weights from paths (attention:weights=PATH)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    # Before torch (and faiss) load OpenMP: idle OpenMP threads sleep instead of spinning. On a
    # busy machine spinning threads make each forward pass up to 20x slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import uvicorn

    from embedpool.app.server import create_app

    settings: Settings = from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=settings.shutdown_timeout, server_header=False)
    return 0
