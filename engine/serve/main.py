"""`eddy serve`: opens the model, starts the engine thread and runs the app under uvicorn."""
from __future__ import annotations

import argparse
import ipaddress
import sys
from typing import TYPE_CHECKING

from ..config import BuildSettings
from ..errors import EddyError

if TYPE_CHECKING:
    from ..build.progress import Progress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--api-key", default=None,
                       help="clients must send 'Authorization: Bearer KEY'; required with a --host other than loopback")
    serve.add_argument("--pin-system", action="store_true",
                       help="keep each conversation's system prompt in the cache forever, as sinks")
    serve.add_argument("--conversations", type=int, default=4,
                       help="conversations whose caches are kept between requests (default 4)")
    serve.add_argument("--max-tokens", type=int, default=512, help="a reply's length when a request names none")
    serve.add_argument("--queue-timeout", type=float, default=60.0,
                       help="seconds a request may wait for the engine before a 503 (default 60)")


def serve(args: argparse.Namespace, settings: BuildSettings, progress: "Progress") -> int:
    if not is_loopback(args.host) and not args.api_key:
        raise EddyError(f"--host {args.host} makes the server reachable from other machines: give it an --api-key")
    import uvicorn

    from ..loader import open_model
    from .app import ServerSettings, create_app
    from .worker import EngineThread

    model = open_model(args.model, settings, progress)
    model_id = model.source.name if model.source else str(args.model)
    engine = EngineThread(model.chat(), args.conversations)
    app = create_app(engine, ServerSettings(model_id, args.api_key, model.chat_defaults, args.pin_system,
                                            args.max_tokens, args.queue_timeout))
    sys.stderr.write(f"eddy serve: {model_id} on http://{args.host}:{args.port}/v1\n")
    sys.stderr.flush()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    engine.close()
    return 0
