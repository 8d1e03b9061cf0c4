"""`eddy serve`: opens the model, starts the engine thread and runs the app under uvicorn."""
from __future__ import annotations

import argparse
import ipaddress
import sys
from typing import TYPE_CHECKING

from ..build_flags import positive_int
from ..config import BuildSettings
from ..errors import EddyError

if TYPE_CHECKING:
    from ..artefacts.progress import Progress


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
    serve.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web page allowed to call the server (its origin, e.g. http://localhost:3000; "
                            "repeatable; '*' for any page, which lets every website you visit use it); "
                            "without it, requests from web pages are refused")
    serve.add_argument("--api-key", default=None,
                       help="clients must send 'Authorization: Bearer KEY'; required with a --host other than loopback")
    serve.add_argument("--pin-system", action="store_true",
                       help="keep each conversation's system prompt in the cache forever, as sinks")
    serve.add_argument("--conversations", type=positive_int, default=4,
                       help="conversations whose caches are kept between requests (default 4)")
    serve.add_argument("--max-tokens", type=positive_int, default=512,
                       help="a reply's length when a request names none")
    serve.add_argument("--max-tokens-limit", type=positive_int, default=32768,
                       help="the longest reply a request may ask for (default 32768)")
    serve.add_argument("--queue-timeout", type=float, default=60.0,
                       help="seconds a request may wait for the engine before a 503 (default 60)")


def serve(args: argparse.Namespace, settings: BuildSettings, progress: "Progress") -> int:
    if not is_loopback(args.host) and not args.api_key:
        raise EddyError(f"--host {args.host} makes the server reachable from other machines: give it an --api-key")
    if args.max_tokens > args.max_tokens_limit:
        raise EddyError(f"--max-tokens {args.max_tokens} is over --max-tokens-limit {args.max_tokens_limit}")
    from ..remote import is_remote

    if is_remote(args.model):
        raise EddyError(f"{args.model} is a server already: point clients at it directly (eddy serve runs a model "
                        "on this machine)")
    import uvicorn

    from ..loader import open_model
    from .app import ServerSettings, create_app
    from .guard import allowed_hosts
    from .listen import listen
    from .worker import EngineThread

    try:
        sock = listen(args.host, args.port)  # before the model: a port in use is said at once
    except OSError as e:
        raise EddyError(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}") from None
    engine = None
    try:
        model = open_model(args.model, settings, progress)
        model_id = model.source.name if model.source else str(args.model)
        engine = EngineThread(model.chat(), args.conversations)
        app = create_app(engine, ServerSettings(
            model_id, args.api_key, model.chat_defaults, args.pin_system, args.max_tokens, args.queue_timeout,
            max_tokens_limit=args.max_tokens_limit, hosts=allowed_hosts(args.host), origins=tuple(args.allow_origin)))
        sys.stderr.write(f"eddy serve: {model_id} on http://{_url_host(args.host)}:{args.port}/v1\n")
        sys.stderr.flush()
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
        if engine is not None:
            engine.close()
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
