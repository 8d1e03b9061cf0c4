"""The `eddy` command line: chat, serve, compile, bench, ppl, cache, models (the contract: docs/CONTRACT.md)."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from typing import TYPE_CHECKING, Sequence

from .build_flags import add_build_options, positive_int, settings_from
from .config import BuildSettings
from .errors import EddyError
from .events import Done, Error, Event, Prefill, PrefillProgress, Reasoning, Token

from .run.generation import EDDY_CHAT_DEFAULTS
from .run.sampling import OPTIONS, SamplingParams

if TYPE_CHECKING:
    from .artefacts.progress import Progress

# What --json prints: docs/CONTRACT.md's lines, and a reasoning model's thinking beside its tokens (the other events
# are for live displays).
JSON_LINES = (Prefill, Token, Reasoning, Done, Error)


def _describe(values: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in values.items() if v)


def _live(stream: "object") -> bool:
    """Whether in-place progress (carriage returns, ANSI erase) belongs on this stream: only on a terminal that
    understands it; a pipe or a log gets plain lines."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
    except (OSError, ValueError):
        return False


def _progress_printer(quiet: bool) -> "Progress":
    """A build's progress on stderr: one line rewritten in place on a terminal, with the words of every stage
    still running (the weights file is written beside the export and the compiler) and the time left; into a log
    or a pipe, where a carriage return does not rewind, a line as each stage starts and ends. bench/scale.py reads
    the "building: STAGE N%" prefix."""
    import time

    from .artefacts.progress import FINISHED, time_left

    words: dict[str, str] = {}
    started = time.monotonic()
    live = _live(sys.stderr)

    def report(stage: str, fraction: float, detail: str = "") -> None:
        if quiet:
            return
        new = stage not in words
        words[stage] = detail
        if live:
            running = " · ".join(w for w in words.values() if w and not w.startswith(FINISHED))
            left = time_left(fraction, time.monotonic() - started)
            line = f"building: {stage} {fraction * 100:3.0f}%" + "".join(f" · {w}" for w in (running, left) if w)
            sys.stderr.write(f"\r\033[K{line}" + ("\n" if stage == "done" else ""))
        elif new or detail.startswith(FINISHED):
            sys.stderr.write(f"building: {stage} {fraction * 100:3.0f}%" + (f" · {detail}" if detail else "") + "\n")
        sys.stderr.flush()

    return report


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="eddy", description="Chat with local language models that never run out of context.")
    sub = top.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="chat in the terminal (each input line is a user turn)",
                          description="Chat in the terminal. Decoding is greedy unless --chat-defaults "
                                      "(repeatable output for scripts and benchmarks).")
    add_build_options(chat)
    chat.add_argument("--prompt", help="answer this one turn and exit")
    chat.add_argument("--api-key", default=None,
                      help="the key of a server given as --model http(s)://HOST:PORT/v1 (default: $EDDY_API_KEY)")
    chat.add_argument("--context", type=positive_int, default=None,
                      help="a server model's context in tokens, over what the server says (which, when it says "
                           "nothing, is taken as 4096)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--pin-system", action="store_true",
                      help="keep the system prompt's tokens in the cache forever, as sinks: the assistant never "
                           "forgets it however long the chat")
    chat.add_argument("--max-new-tokens", type=positive_int, default=512,
                      help="the longest reply, in tokens (default 512)")
    # Unset sampling options take the base: greedy decoding (for scripts and benchmarks) unless --chat-defaults.
    chat.add_argument("--chat-defaults", action="store_true",
                      help="sample as the desktop app does: the model's recommended settings, else Eddy's chat "
                           f"defaults ({_describe(EDDY_CHAT_DEFAULTS)}); without it, decoding is greedy")
    # One flag per sampler option, made from its table (engine.run.sampling.OPTIONS): top_k is --top-k.
    s = SamplingParams()
    for name, option in OPTIONS.items():
        chat.add_argument("--" + name.replace("_", "-"), dest=name, type=option.kind, default=None,
                          help=f"{option.help} (default {getattr(s, name):g})")
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--json", action="store_true", help="one JSON event per line on stdout")

    from .serve.main import add_options as serve_options

    serve = sub.add_parser("serve", help="an OpenAI-compatible server on localhost, over the same engine",
                           description="Serve the model with the OpenAI API (/v1/chat/completions, "
                                       "/v1/completions, /v1/models, /health). Conversations slide through the "
                                       "window instead of failing, and a resent conversation prefills only its "
                                       "new tokens.")
    add_build_options(serve)
    serve_options(serve)

    comp = sub.add_parser("compile", help="build (or find) the compiled artefacts and print their folder")
    add_build_options(comp)

    bench = sub.add_parser("bench", help="measure time to first token, prefill, decode, memory and start-up")
    add_build_options(bench)
    bench.add_argument("--json", dest="json_file", default=None, help="also write the results to this file")
    bench.add_argument("--runs", type=int, default=3, help="repetitions per measurement (medians are reported)")

    cache = sub.add_parser("cache", help="list or delete the compiled models kept in the artefact cache",
                           description="The artefact cache holds one compiled build per model and build settings "
                                       "(a rebuild takes minutes, a warm start a second).")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("list", help="one line per cached build: key, model, settings, size, last used, folder")
    rm = cache_sub.add_parser("rm", help="delete cached builds (they are rebuilt when next used)")
    rm.add_argument("keys", nargs="*", metavar="KEY",
                    help="a key from eddy cache list (or enough of its first digits), or the folder's name")
    rm.add_argument("--all", action="store_true", help="delete every cached build not in use")

    models = sub.add_parser("models", help="list the models already on disk (Hugging Face, LM Studio, GPT4All, Jan, "
                                           "Ollama), each usable as --model PATH",
                            description="List the models other apps have downloaded (the Hugging Face cache, LM "
                                        "Studio, GPT4All, Jan, Ollama) and those in --folder, with the path "
                                        "--model takes: Eddy uses them where they lie, nothing is copied. Models "
                                        "Eddy cannot run are only counted at the end, unless --all lists them, "
                                        "last, each with why (the same in the table and in --json).")
    models.add_argument("--folder", action="append", default=[], metavar="DIR",
                        help="also search this folder and those below it for .gguf files and Hugging Face folders "
                             "(repeatable)")
    models.add_argument("--all", action="store_true", help="also list the models Eddy cannot run, and why")
    models.add_argument("--json", action="store_true",
                        help="a JSON list instead of the table (path, source, name, family, size_bytes, weights, "
                             "params, runnable, reason)")

    from .ppl import DEFAULT_CHUNK, DEFAULT_STRIDE, MODES

    ppl = sub.add_parser("ppl", help="perplexity over a long text file (streaming, window, recompute or dense)")
    add_build_options(ppl)
    ppl.add_argument("--text", required=True, help="UTF-8 text file to score")
    ppl.add_argument("--mode", choices=MODES, default="streaming",
                     help="streaming: sinks + window; window: no sinks, same capacity; recompute: each scored "
                          "token's window recomputed from scratch; dense: no eviction (up to the model's positions)")
    ppl.add_argument("--json", dest="json_file", default=None, help="also write the result and per-position losses here")
    ppl.add_argument("--stride", type=int, default=DEFAULT_STRIDE, help=f"recompute: score every k-th position (default {DEFAULT_STRIDE})")
    ppl.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                     help=f"streaming/window: tokens per call (default {DEFAULT_CHUNK}; 1 = token by token)")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.add_argument("--max-chunk", type=int, default=BuildSettings().max_chunk, help="compiled bound of one call (build setting)")
    ppl.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    return top


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # As SystemExit, so the finally blocks run: a build's child is ended and its staging folder removed
    # (the child would die with this process anyway, but the folder would stay for the next sweep).
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    json_events = getattr(args, "json", False) is True
    previous = None
    if threading.current_thread() is threading.main_thread() and args.command != "serve":
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # serve's shutdown is engine/serve's own
    try:
        return _run(args, json_events)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, json_events: bool) -> int:
    try:
        if args.command == "chat":
            return _chat(args)
        if args.command == "serve":
            from .serve.main import serve

            return serve(args, settings_from(args), _progress_printer(False))
        if args.command == "compile":
            from .artefacts.store import ensure_artefacts
            from .checkpoint import resolve_model

            print(ensure_artefacts(resolve_model(args.model), settings_from(args), _progress_printer(False)))
            return 0
        if args.command == "cache":
            return _cache(args)
        if args.command == "models":
            return _models(args)
        if args.command == "bench":
            from .bench import run_bench

            run_bench(args.model, settings_from(args), args.runs, args.json_file)
            return 0
        if args.command == "ppl":
            from .ppl import run_ppl

            result = run_ppl(args.model, args.text, args.mode, args.sinks, args.window, args.dtype, args.device,
                             args.max_chunk, args.chunk, args.stride, args.max_tokens, args.json_file,
                             None if args.quiet else sys.stderr, _progress_printer(args.quiet), args.kv_dtype)
            print(json.dumps(result), flush=True)
            return 0
    except (EddyError, ValueError, OSError) as e:
        if json_events:
            print(Error(str(e)).to_json(), flush=True)
        print(f"eddy: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _when(seconds: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds)) if seconds else "?"


def _cache(args: argparse.Namespace) -> int:
    from .artefacts.store import artefacts_root
    from .artefacts.cache import CacheError, describe_total, find, list_entries, remove
    from .artefacts.progress import megabytes

    root = artefacts_root()
    if args.cache_command == "list":
        entries = list_entries(root)
        if not entries:
            print(f"no cached builds in {root}")
            return 0
        rows = [("KEY", "MODEL", "BUILD", "SIZE", "LAST USED", "FOLDER")]
        for e in entries:
            used = {"building": "building now", "damaged": "damaged"}.get(e.state, _when(e.last_used))
            rows.append((e.key[:12] or "-", e.model + (" (in use)" if e.in_use else ""), e.summary(),
                         megabytes(e.size), used, str(e.folder)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        print(describe_total(entries, root))
        return 0
    if args.all == bool(args.keys):
        raise CacheError("eddy cache rm takes keys (from eddy cache list) or --all, not both or neither")
    chosen = list_entries(root) if args.all else [find(k, root) for k in args.keys]
    freed, kept = 0, []
    for e in chosen:
        try:
            freed += remove(e, root)
        except CacheError as err:
            if not args.all:
                raise
            kept.append(str(err))  # --all deletes what it can and says what it kept
            continue
        print(f"deleted {e.key[:12] or e.name}  {e.model}  {e.summary()}  {megabytes(e.size)}")
    for why in kept:
        print(f"kept: {why}", file=sys.stderr)
    print(f"freed {megabytes(freed)}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from .artefacts.progress import megabytes
    from .discover import scan

    found = scan(extra_folders=args.folder)
    shown = found if args.all else [m for m in found if m.runnable]
    hidden = len(found) - len(shown)
    if not found.complete:
        print("eddy: the search ran out of time; some models may be missing from the list", file=sys.stderr)
    if args.json:
        print(json.dumps([m.to_json() for m in shown], indent=2))
        return 0
    more = f"{hidden} more that Eddy cannot run: eddy models --all lists them and why." if hidden else ""
    if not shown:
        where = ", ".join(str(p) for p in found.searched)
        print(f"No models {'Eddy can run ' if hidden else ''}found in: {where}")
        if more:
            print(more)
        return 0
    rows = [("NAME", "FAMILY", "PARAMS", "WEIGHTS", "SIZE", "SOURCE", "PATH", "RUNS")]
    for m in shown:
        rows.append((m.name, m.family or "?", m.params or "?", m.weights or "?", megabytes(m.size_bytes), m.source,
                     str(m.path), "yes" if m.runnable else f"no: {m.reason}"))
    if all(m.runnable for m in shown):
        rows = [r[:-1] for r in rows]  # a column of "yes" says nothing
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    if more:
        print(more)
    return 0


CHAT_COMMANDS = {"/help": "list these commands", "/reset": "start a new chat (the model forgets this one)",
                 "/quit": "leave (so do /exit and Ctrl-D)", "/exit": "leave"}
CHAT_HELP = "".join(f"  {name:<7} {what}\n" for name, what in CHAT_COMMANDS.items()) + \
    "  //text  send text that starts with a slash (one slash is dropped)\n"


def _chat_command(text: str) -> str | None:
    """The slash command a line is, or None for a message. "/" alone, a path such as /usr/bin or "//" (the
    escape) are messages: a command is one word of letters."""
    word = text.strip()
    if re.fullmatch(r"/[A-Za-z][\w-]*", word):
        return word.lower()
    return None


def _chat(args: argparse.Namespace) -> int:
    from .loader import open_model
    from .remote import is_remote, open_remote
    from .run.generation import ChatDefaults
    from .run.session import ChatSettings

    given = {name: getattr(args, name) for name in OPTIONS}
    greedy = {name: getattr(SamplingParams(), name) for name in OPTIONS}
    ChatSettings.make(ChatDefaults(greedy), given, args.seed)  # a bad value fails here, before a long build
    if is_remote(args.model):
        # Another machine's model through its OpenAI-compatible server (engine/remote.py): nothing is built.
        model = open_remote(args.model, args.api_key, args.context)
        where = f"{model.info.model} at {model.source.url}"
    else:
        model = open_model(args.model, settings_from(args), _progress_printer(args.json))
        where = None
    base = model.chat_defaults if args.chat_defaults else ChatDefaults(greedy)
    session = model.chat(ChatSettings.make(base, given, args.seed, system_prompt=args.system,
                                           max_new_tokens=args.max_new_tokens, pin_system=args.pin_system))

    live = _live(sys.stderr)

    def on_event(event: Event) -> None:
        if args.json:
            if isinstance(event, JSON_LINES):
                print(event.to_json(), flush=True)
        elif isinstance(event, PrefillProgress):
            line = f"reading a long message: {event.done:,}/{event.total:,} tokens"
            if live:
                sys.stderr.write(f"\r\033[K{line}" + ("\n" if event.done == event.total else ""))
            elif event.done == event.total:
                sys.stderr.write(line + "\n")  # a log gets the outcome, not a line per chunk
            sys.stderr.flush()
        elif isinstance(event, Reasoning):
            # Thinking goes to stderr, dimmed on a terminal: stdout stays the answer alone, for pipes.
            sys.stderr.write(f"\033[2m{event.text}\033[0m" if live else event.text)
            sys.stderr.flush()
        elif isinstance(event, Token):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Done):
            sys.stdout.write("\n")
            c = event.cache
            sys.stderr.write(f"[{event.tokens} tokens, {event.tok_s:.1f} tok/s; cache {c.used}/{c.capacity}, "
                             f"{c.evicted} evicted]\n")

    def turn(text: str) -> None:
        # Generation runs on a worker thread so Ctrl-C only stops the reply (via the session's stop flag).
        failure: list[BaseException] = []

        def work() -> None:
            try:
                session.answer(text, on_event)
            except BaseException as e:  # re-raised on the main thread
                failure.append(e)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while worker.is_alive():
            try:
                worker.join(0.1)
            except KeyboardInterrupt:
                session.stop()
        if failure:
            raise failure[0]

    if args.prompt is not None:
        turn(args.prompt)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        from .gpu import device_name

        sys.stderr.write(f"Eddy on {where or device_name(model.engine.settings)} — type a message, /help for the "
                         f"commands, /quit or Ctrl-D to leave.\n")
    while True:
        if interactive:
            sys.stderr.write("\n> ")
            sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            return 0
        if not line:
            return 0
        text = line.rstrip("\n")
        command = _chat_command(text)
        if command in ("/quit", "/exit"):
            return 0
        if command == "/reset":
            session.reset()
            continue
        if command == "/help":
            sys.stderr.write(CHAT_HELP)
            continue
        if command is not None:
            print(f"eddy: unknown command {command} (/help lists them)", file=sys.stderr)
            continue
        if text.startswith("//"):
            text = text[1:]  # the escape for a message that starts with a slash
        try:
            turn(text)
        except EddyError as e:  # one bad turn (say, too long) does not end the chat
            if args.json:
                print(Error(str(e)).to_json(), flush=True)
            print(f"eddy: error: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
