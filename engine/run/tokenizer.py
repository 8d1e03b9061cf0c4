"""Tokenizer and chat template for the runtime: `tokenizers` + a sandboxed Jinja template, no torch/transformers.

A model folder holds `tokenizer.json` (Hugging Face `tokenizers` format) and `chat.json`:
    {"chat_template": str, "bos_token": str|null, "eos_token": str|null,
     "stop_tokens": [str, ...], "add_bos_token": bool}
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding, Tokenizer as _HFTokenizer

from ..errors import ModelError
from . import template_tail
from .reasoning import THINK_OPEN

TOKENIZER_FILE = "tokenizer.json"
CHAT_FILE = "chat.json"

# Private-use characters for sentinels; a pair is picked that occurs in no content, so splitting is unambiguous.
_SENTINEL_CHARS = [chr(c) for c in range(0xE000, 0xE020)]
# Stand-in content for an assistant turn when measuring the text that closes it.
_PROBE_CONTENT = "Eddy"
# A tail render's answer is compared with the full render's this many times per tokenizer (per kind of call)
# before it is trusted alone: a cheap second line of defence behind template_tail.locality's proof.
_TAIL_CHECKS = 3
# Returned by a tail render that cannot vouch for its answer; the full render then gives it.
_UNSURE = object()
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` as valid Unicode: UTF-16 surrogate pairs joined, lone surrogates replaced by U+FFFD.

    A Python str may hold lone surrogates (stdin decoded with surrogateescape, text from UTF-16 sources), which
    the Rust tokenizer and SQLite both reject with a TypeError/UnicodeEncodeError rather than a clear message.
    """
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# Work a template may do in one render: range items and the length of a repeated string or list. Real chat
# templates loop over the messages; a template from an untrusted model folder must not hang or exhaust memory
# (nested range(99999) loops, 'x' * 10**10).
_MAX_ITEMS = 1_000_000
# Text a template may build in one render, every piece counted when it is made (output, `~`, `+`, `%`, filters,
# str methods), and counted *before* it is made, so a string doubled in a loop fails at a few megabytes rather
# than after gigabytes. Real templates build a few times their output; the long-chat test renders ~0.2 MB.
_MAX_TEXT = 16_000_000
_budget = threading.local()


def _range(*args: int) -> range:
    r = range(*args)
    left = getattr(_budget, "left", _MAX_ITEMS) - len(r)
    if left < 0:
        raise SecurityError(f"the template loops more than {_MAX_ITEMS} times")
    _budget.left = left
    return r


def _charge(n: int) -> None:
    left = getattr(_budget, "text", _MAX_TEXT) - n
    if left < 0:
        raise SecurityError(f"the template builds more than {_MAX_TEXT} characters of text")
    _budget.text = left


def _text_size(x: Any, limit: int | None = None, depth: int = 0) -> int:
    """About len(str(x)), found without building it, and given up on (returned as more than `limit`) as soon
    as it passes `limit`, so measuring a huge value costs no more than the budget it is measured against."""
    limit = getattr(_budget, "text", _MAX_TEXT) if limit is None else limit
    if isinstance(x, str):
        return len(x)
    if isinstance(x, (bytes, bytearray)):
        return len(x) * 4
    if isinstance(x, bool) or x is None:
        return 5
    if isinstance(x, jinja2.Undefined):
        return 0  # renders as nothing (or fails): no text is made
    if isinstance(x, int):
        return x.bit_length() // 3 + 2
    if isinstance(x, float):
        return 32
    if depth > 50:
        return limit + 1  # a structure this deep is no chat
    if isinstance(x, jinja2.utils.Namespace):
        x = object.__getattribute__(x, "_Namespace__attrs")
    if isinstance(x, dict):
        items: Any = (i for kv in x.items() for i in kv)
    elif isinstance(x, (list, tuple, set, frozenset)):
        items = iter(x)
    else:
        return 100
    total = 2
    for item in items:
        total += _text_size(item, limit - total, depth + 1) + 4  # quotes, separator
        if total > limit:
            break
    return total


def _format_bound(fmt: str, args: Any, kwargs: dict | None = None) -> int:
    """A bound on the length of fmt % args or fmt.format(*args, **kwargs): every field as long as the longest
    argument padded to the widest width or precision the format can name."""
    values = list(args) if isinstance(args, (list, tuple)) else [args]
    values += list((kwargs or {}).values())
    if len(values) == 1 and isinstance(values[0], dict):
        values = list(values[0].values())
    widths = [int(d) for d in re.findall(r"\d+", fmt) if len(d) < 19]
    if "*" in fmt or re.search(r"\{[^{}]*\{", fmt):  # widths that come from the arguments
        widths += [v for v in values if isinstance(v, int)]
    longest = max((_text_size(v) for v in values), default=0)
    fields = fmt.count("{") + fmt.count("%") + 1
    return len(fmt) + fields * (longest + max(widths, default=0))


def _replace_bound(s: str, old: str, new: str, count: int | None = None) -> int:
    n = (s.count(old) if old else len(s) + 1)
    if count is not None and count >= 0:
        n = min(n, count)
    return len(s) + n * len(new)


# str methods whose result can be much longer than their input, each with a bound on that result.
_STR_GROWTH: dict[str, Callable[..., int]] = {
    "ljust": lambda s, width=0, *a: max(width, len(s)),
    "rjust": lambda s, width=0, *a: max(width, len(s)),
    "center": lambda s, width=0, *a: max(width, len(s)),
    "zfill": lambda s, width=0: max(width, len(s)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(tabsize, 0),
    "replace": lambda s, old="", new="", count=-1: _replace_bound(s, old, new, count),
    "translate": lambda s, table=None: len(s) * max([_text_size(v) for v in table.values()] or [1])
    if isinstance(table, dict) else len(s),
}


def _grown(s: str, name: str, args: tuple, kwargs: dict) -> int:
    bound = _STR_GROWTH.get(name)
    if bound is None:
        return 0
    try:
        return bound(s, *args, **kwargs)
    except TypeError:
        return 0  # the call itself will fail with Python's own message


def _charge_result(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)):
        _charge(len(value))
    return value


def _budgeted_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """The filter, its result charged to the text budget, and the ones that can grow text checked first."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) else 0

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        lead, rest = args[:skip], list(args[skip:])
        value = rest[0] if rest else kwargs.get("value")
        if name == "join" and rest:
            items = list(rest[0])
            sep = rest[1] if len(rest) > 1 else kwargs.get("d", "")
            attribute = rest[2] if len(rest) > 2 else kwargs.get("attribute")
            shown = items if attribute is None else [jinja2.filters.make_attrgetter(lead[0].environment, attribute)(i)
                                                     for i in items]
            _charge(sum(_text_size(i) for i in shown) + len(str(sep)) * len(items))
            rest[0] = items
        elif name == "replace" and len(rest) >= 3:
            _charge(_replace_bound(str(rest[0]), str(rest[1]), str(rest[2]),
                                   rest[3] if len(rest) > 3 else kwargs.get("count")))
        elif name == "format" and rest:
            _charge(_format_bound(str(rest[0]), tuple(rest[1:]), kwargs))
        elif name == "center" and rest:
            _charge(max(int(rest[1] if len(rest) > 1 else kwargs.get("width", 80)), len(str(rest[0]))))
        elif name == "indent" and rest:
            width = rest[1] if len(rest) > 1 else kwargs.get("width", 4)
            text = str(rest[0])
            _charge(len(text) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else int(width)))
        elif name == "wordwrap" and rest:
            wrap = rest[3] if len(rest) > 3 else kwargs.get("wrapstring") or "\n"
            _charge(len(str(rest[0])) * (1 + len(wrap)))
        elif name in ("batch", "slice") and len(rest) > 1:
            _charge(int(rest[1]))
        elif name in ("string", "pprint", "urlencode", "urlize", "xmlattr", "escape", "e", "forceescape") \
                and value is not None:
            _charge(_text_size(value) * (3 if name.startswith("url") else 1))
        return _charge_result(f(*lead, *rest, **kwargs))

    return run


class _BudgetedCodeGenerator(jinja2.compiler.CodeGenerator):
    # `~` compiles to a direct call of jinja's str_join, which no sandbox hook sees: route it through the
    # environment so its result is measured before it is made.
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.budgeted_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BudgetedCodeGenerator

    # Jinja's default is to return a silent Undefined for a blocked attribute, which can render as "" and hide
    # an attack; a chat template has no business touching internals, so refuse loudly.
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > _MAX_ITEMS:
                        raise SecurityError(f"the template builds a value of more than {_MAX_ITEMS} items")
                    _charge(len(seq) * n)
        if operator == "**" and isinstance(right, int) and right > 256 and isinstance(left, int) and abs(left) > 1:
            raise SecurityError("the template computes a number too large")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _charge(len(left) + len(right))
        if operator == "%" and isinstance(left, str):
            _charge(_format_bound(left, right))
        return super().call_binop(context, operator, left, right)

    def budgeted_concat(self, values: tuple) -> str:
        _charge(sum(_text_size(v) for v in values))
        return jinja2.runtime.str_join(values)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            _charge(_grown(owner, name, args, kwargs))
            if name == "join" and args:
                items = list(args[0])
                _charge(sum(_text_size(i) for i in items) + len(owner) * len(items))
                args = (items, *args[1:])
        elif __obj is jinja2.utils.generate_lorem_ipsum:
            _charge(int(args[0] if args else kwargs.get("n", 5)) * 1000)
        elif __obj is _strftime_now:
            _charge(len(str(args[0] if args else kwargs.get("fmt", ""))) * 16)
        return _charge_result(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        inner = super().wrap_str_format(value)
        if inner is None:
            return None
        fmt = str(value.__self__)

        def checked(*args: Any, **kwargs: Any) -> str:
            _charge(_format_bound(fmt, args, kwargs))
            return inner(*args, **kwargs)

        return checked


def _finalize(value: Any) -> Any:
    # Every {{ output }} is charged: a template can print one huge value a million times without storing it.
    _charge(_text_size(value))
    return value


class _Namespace(jinja2.utils.Namespace):
    # Same hardening as transformers: underscore names on a namespace are a known route to internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates are written against the transformers variant. Encoded piece by
    # piece, each charged as it comes, so [big] * 1000 or a huge indent fails before the text exists.
    if isinstance(indent, int) and indent > 64:
        raise SecurityError("the template asks tojson for an indent of more than 64")
    pieces = []
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for piece in encoder.iterencode(x, _one_shot=False):
        _charge(len(piece))
        pieces.append(piece)
    return "".join(pieces)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_is_patched() -> bool:
    # Jinja before 3.1.6 has known sandbox escapes (str.format via |attr), and chat templates are untrusted code.
    parts = re.findall(r"\d+", jinja2.__version__)[:3]
    return tuple(int(p) for p in parts) >= (3, 1, 6)


def _environment() -> _Sandbox:
    # Settings mirror transformers' apply_chat_template so prompts match what the model was trained on.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=_finalize)
    return env


def _compile_template(source: str, where: Path) -> jinja2.Template:
    if not _jinja_is_patched():
        raise ModelError(f"jinja2 {jinja2.__version__} has known sandbox escapes; Eddy needs jinja2 >= 3.1.6")
    env = _environment()
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = lambda *a, **kw: dict(*a, **kw)
    env.globals["range"] = _range
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ModelError(f"{where}: chat_template does not compile: {exc}") from exc


def _locality(source: str) -> template_tail.Locality | None:
    try:
        return template_tail.locality(_environment().parse(source))
    except TemplateError:
        return None


def _render_budgeted(template: jinja2.Template, **context: Any) -> str:
    _budget.left = _MAX_ITEMS
    _budget.text = _MAX_TEXT
    try:
        return template.render(**context)
    except SecurityError as exc:
        raise ModelError(f"chat template is unsafe: {exc}") from exc
    except (Exception, RecursionError, MemoryError) as exc:  # a template may fail in any way
        raise ModelError(f"chat template failed: {str(exc) or type(exc).__name__}") from exc


def render_template(source: str, messages: list[dict], add_generation_prompt: bool, bos_token: str = "",
                    eos_token: str = "", where: Path = Path("chat_template")) -> str:
    """Renders an untrusted chat template once, in the same sandbox and work budget as a Tokenizer's.

    ModelError if it does not compile, is unsafe or fails."""
    return _render_budgeted(_compile_template(source, where), messages=messages,
                            add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token)


def _load_chat_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelError(f"{path}: file is missing")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: cannot be read: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelError(f"{path}: expected a JSON object")

    def check(key: str, ok: bool, expected: str) -> None:
        if not ok:
            raise ModelError(f"{path}: {key!r} must be {expected}, got {cfg.get(key)!r}")

    check("chat_template", isinstance(cfg.get("chat_template"), str), "a string")
    for key in ("bos_token", "eos_token"):
        check(key, cfg.get(key) is None or isinstance(cfg[key], str), "a string or null")
    stops = cfg.get("stop_tokens", [])
    check("stop_tokens", isinstance(stops, list) and all(isinstance(s, str) for s in stops), "a list of strings")
    check("add_bos_token", isinstance(cfg.get("add_bos_token", False), bool), "true or false")
    return cfg


def _merge(pieces: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    # Canonical form (no empties, neighbours of the same kind joined) so piece lists can be compared for equality.
    out: list[tuple[str, bool]] = []
    for text, is_user in pieces:
        if not text:
            continue
        if out and out[-1][1] == is_user:
            out[-1] = (out[-1][0] + text, is_user)
        else:
            out.append((text, is_user))
    return out


def _split_at(pieces: list[tuple[str, bool]], pos: int) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    head: list[tuple[str, bool]] = []
    tail: list[tuple[str, bool]] = []
    for text, is_user in pieces:
        cut = min(max(pos, 0), len(text))
        head.append((text[:cut], is_user))
        tail.append((text[cut:], is_user))
        pos -= len(text)
    return _merge(head), _merge(tail)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Tokenizer:
    """Text <-> ids, and chat rendering that never lets user-typed text become control tokens."""

    def __init__(self, tok: _HFTokenizer, cfg: dict[str, Any], where: Path) -> None:
        self._tok = tok
        # encode_text flips the shared encode_special_tokens flag; the lock keeps concurrent callers from seeing
        # each other's setting (cheaper than a second parsed copy of the vocabulary).
        self._lock = threading.Lock()
        self._template_source: str = cfg["chat_template"]
        # What the template is rendered with besides the messages (tools, enable_thinking): with_extras.
        self._extras: dict[str, Any] = {}
        self._extras_text = ""
        self._variants: dict[str, Tokenizer] = {}
        self._variants_lock = threading.Lock()  # the engine thread and a server's request threads both ask
        self._grammars: Any = None
        self._template = _compile_template(self._template_source, where)
        self._bos_token: str | None = cfg.get("bos_token")
        self._eos_token: str | None = cfg.get("eos_token")
        self._add_bos: bool = cfg.get("add_bos_token", False)
        # Tail rendering (see template_tail): the proof for this template, the chats it may be used for, and
        # how many of its answers are still to be checked against a full render.
        self._locality = _locality(self._template_source)
        self._chats = template_tail.Conversations(frozenset(_SENTINEL_CHARS))
        self._checks_left = {"delta": _TAIL_CHECKS, "suffix": _TAIL_CHECKS}
        self._tail_trusted = self._locality is not None
        self.tail_stats: dict[str, int] = {"tail": 0, "full": 0, "mismatch": 0}

        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self.bos_id: int | None = tok.token_to_id(self._bos_token) if self._bos_token else None
        if self._add_bos and self.bos_id is None:
            raise ModelError(f"{where}: add_bos_token is set but bos_token {self._bos_token!r} is not in the vocabulary")
        stops = [*cfg.get("stop_tokens", []), *([self._eos_token] if self._eos_token else [])]
        ids = (tok.token_to_id(s) for s in stops)
        self.stop_ids: frozenset[int] = frozenset(i for i in ids if i is not None)
        if not self.stop_ids:
            # Generation could then only end at the length limit, which is never what the model intends.
            raise ModelError(f"{where}: none of the stop tokens {stops} is in the vocabulary")

    @classmethod
    def from_dir(cls, folder: Path) -> "Tokenizer":
        folder = Path(folder)
        tok_path = folder / TOKENIZER_FILE
        if not tok_path.is_file():
            raise ModelError(f"{tok_path}: file is missing")
        try:
            tok = _HFTokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust side raises plain Exception for any parse problem
            raise ModelError(f"{tok_path}: corrupt or unsupported tokenizer file: {exc}") from exc
        chat_path = folder / CHAT_FILE
        return cls(tok, _load_chat_config(chat_path), chat_path)

    # --- what the template is given -------------------------------------------------------------------------

    @property
    def template_source(self) -> str:
        return self._template_source

    def with_extras(self, extras: dict[str, Any] | None) -> "Tokenizer":
        """This tokenizer rendering its template with `extras` beside the messages (transformers' apply_chat_template
        keywords: `tools`, `enable_thinking`, ...). The same vocabulary; a chat's tail-rendering state of its own.
        A few are kept, so a client that sends the same tools every request gets the same one back."""
        if not extras:
            return self
        base = self._base
        key = json.dumps(extras, sort_keys=True, ensure_ascii=False)
        with base._variants_lock:
            return base._variant(key, extras)

    def _variant(self, key: str, extras: dict[str, Any]) -> "Tokenizer":
        base = self
        variant = base._variants.get(key)
        if variant is None:
            if len(base._variants) >= 8:
                base._variants.pop(next(iter(base._variants)))
            variant = copy.copy(base)
            variant._extras, variant._extras_text = dict(extras), key
            variant._chats = template_tail.Conversations(frozenset(_SENTINEL_CHARS))
            variant._checks_left = {"delta": _TAIL_CHECKS, "suffix": _TAIL_CHECKS}
            variant._base_ref = base
            variant.__dict__.pop("opens_thinking", None)  # the base's answer, without these extras
            base._variants[key] = variant
        return variant

    @property
    def _base(self) -> "Tokenizer":
        return getattr(self, "_base_ref", self)

    def control_text_in(self, text: str) -> str | None:
        """The first special token's text found in `text`, else None. Text a template writes as its own (a
        tool's definition, a call's arguments) is encoded with its special tokens live, so a client's such text
        is checked with this first."""
        return next((t for t in self._special_texts() if t in text), None)

    def special_id(self, text: str) -> int | None:
        """The id of the special token whose text is `text`, else None."""
        tid = self._tok.token_to_id(text)
        return tid if tid is not None and tid in self._special_ids else None

    @functools.cache  # noqa: B019  (one per tokenizer, which lives as long as its model)
    def _special_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content)

    @property
    def grammars(self) -> Any:
        """The constraint side's view of this vocabulary (engine/run/constraint.py), made on first use."""
        base = self._base
        if base._grammars is None:
            from .constraint import Grammars

            base._grammars = Grammars(base._tok.to_str(), base.stop_ids, base.vocab_size)
        return base._grammars

    @functools.cached_property
    def opens_thinking(self) -> bool:
        """Whether the generation prompt itself opens a thinking block (Qwen3's and DeepSeek-R1's templates end it
        with "<think>\n"): the reply then starts inside it."""
        try:
            text = self._run_template([{"role": "user", "content": "A"}], True)
        except ModelError:
            return False
        return text.rstrip().endswith(THINK_OPEN)

    # --- encoding -------------------------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        return self._encode(text, specials=False)

    def encode_template(self, text: str) -> list[int]:
        return self._encode(text, specials=True)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (no chat template; its text stays text) as the model expects one: BOS first if it wants it."""
        ids = self.encode_text(text)
        return [self.bos_id, *ids] if self._add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def detokenizer(self) -> "StreamDecoder":
        return StreamDecoder(self)

    # --- chat -----------------------------------------------------------------------------------------------

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[tuple[str, bool]]:
        """Rendered prompt as (text, is_user_content) pieces; message contents are the True pieces."""
        return _merge([(text, idx is not None) for text, idx in self._render(messages, add_generation_prompt)])

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        ids = self._encode_pieces(self.render(messages, add_generation_prompt))
        if self._add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def chat_delta(self, history: list[dict], new_messages: list[dict],
                   add_generation_prompt: bool = True) -> list[int] | None:
        """Ids to append after a cache holding `history` (rendered without generation prompt), or None when the
        template renders the longer conversation with a different beginning and the cache must be rebuilt.

        In a long chat this tokenizer has seen before, only the tail is rendered (see template_tail), with the
        same answer as the full render."""
        if not history:
            return self.encode_chat(new_messages, add_generation_prompt)
        stand_in = self._stand_in(history)
        if stand_in is not None:
            fast = self._tail_delta(*stand_in, new_messages, add_generation_prompt)
            full = functools.partial(self._full_delta, history, new_messages, add_generation_prompt)
            if fast is not _UNSURE and self._confirmed("delta", fast, full):
                self._chats.record([*history, *new_messages], len(history) - 1)
                return fast  # type: ignore[return-value]
        self.tail_stats["full"] += 1
        delta = self._full_delta(history, new_messages, add_generation_prompt)
        # history[:-1] has now rendered without error, with and without the generation prompt, in places where
        # its rendering no longer changes as the chat grows: later turns may leave those messages out.
        self._chats.record([*history, *new_messages], len(history) - 1)
        return delta

    def _full_delta(self, history: list[dict], new_messages: list[dict],
                    add_generation_prompt: bool) -> list[int] | None:
        base = self.render(history, False)
        return self._delta(history, base, self.render([*history, *new_messages], add_generation_prompt))

    def _delta(self, history: list[dict], base: list[tuple[str, bool]],
               full: list[tuple[str, bool]]) -> list[int] | None:
        head, tail = _split_at(full, sum(len(t) for t, _ in base))
        # Equal pieces (not just equal strings) mean the cache holds exactly encode(head). The tail is encoded on
        # its own; when the seam is not at a special token a merge across it is lost, which the model tolerates
        # far better than a full rebuild (ChatML's seam is always "\n" | "<|im_start|>", so it is exact there).
        if head != base:
            return self._delta_after_closing(history, base, full)
        return self._encode_pieces(tail)

    def _delta_after_closing(self, history: list[dict], base: list[tuple[str, bool]],
                             full: list[tuple[str, bool]]) -> list[int] | None:
        """Some templates end a conversation with text they write only at its very end (Phi-3 adds eos_token when
        there is no generation prompt). After an assistant turn the cache holds its closing text only up to where
        that ending and the continuation part (in tokens: what turn_suffix gives), so the delta starts there.
        None if anything earlier differs, or the history does not end with the assistant's reply."""
        if len(base) < 2 or base[-1][1] or history[-1].get("role") != "assistant":
            return None
        head, rest = _split_at(full, sum(len(t) for t, _ in base[:-1]))
        if head != base[:-1]:
            return None
        ending, going_on = self._encode_pieces(base[-1:]), self._encode_pieces(rest)
        return going_on[common_prefix(ending, going_on):]

    def turn_suffix(self, history: list[dict]) -> str:
        """Template text that closes an assistant turn (ChatML: "<|im_end|>\\n"), or "" if it cannot be told.

        Only what the template writes whether or not the conversation goes on: Phi-3's closes the last turn of a
        conversation with "<|end|>\\n<|endoftext|>" but a turn followed by another with "<|end|>\\n"."""
        stand_in = self._stand_in(history)
        if stand_in is not None:
            try:
                fast: Any = self._turn_suffix(*stand_in, strict=True)
            except ModelError:
                fast = _UNSURE  # the full render says whether the error is real
            if fast is not _UNSURE and self._confirmed("suffix", fast, lambda: self._turn_suffix(history)):
                return fast
        self.tail_stats["full"] += 1
        return self._turn_suffix(history)

    def _turn_suffix(self, history: list[dict], marks: frozenset[str] = frozenset(), strict: bool = False) -> str:
        probe = [*history, {"role": "assistant", "content": _PROBE_CONTENT}]
        ending = self._closing_text(probe, marks, strict)
        going_on = self._closing_text([*probe, {"role": "user", "content": _PROBE_CONTENT}], marks, strict)
        if not going_on or going_on.startswith(ending):
            return ending
        ids = self.encode_template(ending)
        return self.decode(ids[:common_prefix(ids, self.encode_template(going_on))])

    def _closing_text(self, probe: list[dict], marks: frozenset[str] = frozenset(),
                      strict: bool = False) -> str | None:
        """The template text right after the content of probe's last assistant message (None: no render).

        `strict`: a failed render raises instead (a tail render cannot tell whether the full one would fail)."""
        try:
            pieces = self._render(probe, False, marks)
        except ModelError:
            if strict:
                raise
            return None if probe[-1]["role"] != "assistant" else ""
        last = max(i for i, m in enumerate(probe) if m["role"] == "assistant")
        positions = [i for i, (_, idx) in enumerate(pieces) if idx == last]
        if not positions:
            return ""
        suffix = ""
        for text, idx in pieces[positions[-1] + 1:]:
            if idx is not None:
                break
            suffix += text
        return suffix

    # --- tail rendering -------------------------------------------------------------------------------------

    def _stand_in(self, history: list[dict]) -> tuple[list[dict], frozenset[str]] | None:
        """A short list the template renders with the same tail as `history`, and the sentinel candidates the
        left-out messages use; None where the template is not proven local, or the messages that would be left
        out are not settled in a chat already rendered."""
        loc = self._locality
        if loc is None or not self._tail_trusted:
            return None
        n = len(history)
        tail = loc.tail + (n - loc.head - loc.tail) % 2  # leave out an even number: loop.index0 % 2 holds
        skip = n - loc.head - tail
        if skip < 2:
            return None  # nothing worth leaving out
        settled, marks = self._chats.known(history)
        if settled < loc.head + skip:
            return None
        return [*history[:loc.head], *history[n - tail:]], marks

    def _tail_delta(self, short: list[dict], marks: frozenset[str], new_messages: list[dict],
                    add_generation_prompt: bool) -> Any:
        """chat_delta computed on a stand-in, or _UNSURE where the stand-in's renders cannot vouch for it."""
        anchor = self._locality.head if self._locality else 0
        try:
            base = self._tail_read(short, False, marks, anchor)
            full = self._tail_read([*short, *new_messages], add_generation_prompt, marks, anchor)
        except ModelError:
            return _UNSURE
        # The left-out messages render, identically in both, somewhere before the anchor. With everything up to
        # it equal, inserting them shifts both renders alike and the comparisons of _delta come out the same.
        if base is None or full is None or base[0] != full[0]:
            return _UNSURE
        return self._delta(short, base[1], full[1])

    def _tail_read(self, messages: list[dict], add_generation_prompt: bool, marks: frozenset[str],
                   anchor: int) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]] | None:
        """(pieces up to the content of messages[anchor], all pieces) of a stand-in's render; None if the anchor
        cannot be found, or the contents had to be read as trimmed: which reading the full render picks depends
        on every message, the left-out ones too, while the raw one is what it picks whenever the stand-in's is."""
        pieces, raw = self._read(messages, add_generation_prompt, marks)
        at = next((i for i, (_, idx) in enumerate(pieces) if idx == anchor), None)
        if not raw or at is None or any(idx is not None and idx > anchor for _, idx in pieces[:at]):
            return None
        tagged = [(text, idx is not None) for text, idx in pieces]
        return _merge(tagged[:at + 1]), _merge(tagged)

    def _confirmed(self, kind: str, fast: Any, full: Callable[[], Any]) -> bool:
        """Whether a tail render's answer may be used: the first few are checked against the full render, and
        one that differs turns tail rendering off for this tokenizer."""
        if self._checks_left[kind] > 0:
            if fast != full():
                self._tail_trusted = False
                self.tail_stats["mismatch"] += 1
                return False
            self._checks_left[kind] -= 1
        self.tail_stats["tail"] += 1
        return True

    # --- internals ------------------------------------------------------------------------------------------

    def _encode(self, text: str, specials: bool) -> list[int]:
        text = valid_text(text)
        with self._lock:
            self._tok.encode_special_tokens = not specials
            try:
                return self._encode_one(text).ids
            finally:
                self._tok.encode_special_tokens = False

    def _encode_one(self, text: str) -> Encoding:
        # encode_batch, not encode: the same pipeline and ids, but it lets go of the GIL while it works. A long
        # chat's rendering is one ~250k-character run (80-170 ms); encode held the GIL through it, and the GUI
        # thread stood still that long while the engine thread put the chat back into the cache.
        return self._tok.encode_batch([text], add_special_tokens=False)[0]

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        # Only special tokens found inside template text become control ids. The text between them is encoded
        # as one run even where template text and content meet, so BPE merges across that seam exactly as
        # transformers' apply_chat_template would (e.g. "\n" + "  text" -> "\n " + " text").
        ids: list[int] = []
        run = ""
        for text, is_user in pieces:
            if is_user:
                run += text
                continue
            text = valid_text(text)
            with self._lock:
                enc = self._encode_one(text)
            pos = 0
            for tid, (start, end) in zip(enc.ids, enc.offsets):
                if tid in self._special_ids:
                    ids += self.encode_text(run + text[pos:start])
                    ids.append(tid)
                    run, pos = "", end
            run += text[pos:]
        return ids + self.encode_text(run)

    def _run_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return _render_budgeted(self._template, **self._extras, messages=messages,
                                add_generation_prompt=add_generation_prompt, bos_token=self._bos_token or "",
                                eos_token=self._eos_token or "")

    def _render(self, messages: list[dict], add_generation_prompt: bool,
                marks: frozenset[str] = frozenset()) -> list[tuple[str, int | None]]:
        return self._read(messages, add_generation_prompt, marks)[0]

    def _read(self, messages: list[dict], add_generation_prompt: bool,
              marks: frozenset[str] = frozenset()) -> tuple[list[tuple[str, int | None]], bool]:
        # Pieces tagged with the index of the message whose content they are (None: template text), and whether
        # the contents were read as they are (not trimmed). Contents are swapped for sentinels so the template's
        # own text can be told apart from anything a user typed. `marks`: sentinel candidates used by messages
        # a stand-in leaves out, so it fails exactly where the full render would.
        contents = [m.get("content") for m in messages]
        used = set(self._template_source).union(marks, self._extras_text,
                                                *(v for m in messages for v in m.values() if isinstance(v, str)),
                                                *(json.dumps(v, ensure_ascii=False) for m in messages
                                                  for v in m.values() if isinstance(v, (list, dict))))
        free = [c for c in _SENTINEL_CHARS if c not in used]
        if len(free) < 2:
            raise ModelError("chat template failed: messages use every sentinel character")
        open_, close = free[0], free[1]
        swapped = [
            {**m, "content": f"{open_}{i}{close}"} if isinstance(contents[i], str) else m
            for i, m in enumerate(messages)
        ]
        rendered = self._run_template(swapped, add_generation_prompt)
        parts = re.split(f"{open_}(\\d+){close}", rendered)
        indices = [int(p) for p in parts[1::2]]
        templ = parts[0::2]
        if any(open_ in t or close in t for t in templ):
            raise ModelError("chat template failed: it alters message content in a way that cannot be followed")

        real = self._run_template(messages, add_generation_prompt)
        # Templates may transform content (commonly `| trim`); use whichever reading reproduces the real render.
        # If none does, keep the raw contents: the prompt may differ slightly but user text still stays text.
        chosen = [contents[i] for i in indices]
        raw = False
        for n, candidate in enumerate((chosen, [c.strip() for c in chosen])):
            joined = "".join(t + c for t, c in zip(templ, candidate)) + templ[-1]
            if joined == real:
                chosen, raw = candidate, n == 0
                break

        pieces: list[tuple[str, int | None]] = [(templ[0], None)]
        for idx, content, text in zip(indices, chosen, templ[1:]):
            pieces += [(content, idx), (text, None)]
        return pieces, raw


class StreamDecoder:
    """Incremental detokenisation: push token ids one at a time, get text deltas that never contain broken UTF-8
    (a partial multi-byte character is held back, U+FFFD never emitted for an incomplete sequence), and whose
    concatenation equals tokenizer.decode(all ids) exactly (including special tokens as text, e.g. '<|im_end|>')."""

    # The window is trimmed back to _KEEP tokens of left context once it exceeds _MAX, so a push costs O(1).
    _KEEP = 6
    _MAX = 24

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._emitted = 0  # characters of decode(self._ids) already handed out

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        # Only trailing U+FFFD can still change (an unfinished byte sequence; with byte-fallback vocabularies a
        # whole run of them), so hold those back and hand out everything before.
        stable = len(text.rstrip("\ufffd"))
        out = text[self._emitted:stable]
        self._emitted = max(self._emitted, stable)
        if len(self._ids) > self._MAX:
            self._trim(text)
        return out

    def flush(self) -> str:
        out = self._decode(self._ids)[self._emitted:]
        self._ids, self._emitted = [], 0
        return out

    def _trim(self, text: str) -> None:
        # Dropping leading ids is safe where the shorter window decodes to an exact suffix of the current text
        # (not mid-character, decoder in step) that still covers everything not yet handed out.
        pending = len(text) - self._emitted
        # A few candidates suffice: in ordinary text a clean boundary is never far away; else retry next push.
        first = len(self._ids) - self._KEEP
        for start in range(first, max(first - 8, 0), -1):
            rest = self._decode(self._ids[start:])
            if len(rest) >= pending and text.endswith(rest):
                self._ids = self._ids[start:]
                self._emitted = len(rest) - pending
                return
