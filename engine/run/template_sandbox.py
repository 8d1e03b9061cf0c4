"""The sandbox untrusted chat templates render in: a hardened Jinja environment with a work budget per render.

A chat template comes from a model folder, so it is untrusted code: it must not reach Python internals, hang, or
exhaust memory. No torch/transformers; the Tokenizer (engine/run/tokenizer.py) and the export-time probes both
render through here so a template behaves the same in both.
"""

from __future__ import annotations

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

from ..errors import ModelError
from . import template_tail

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


def compile_template(source: str, where: Path) -> jinja2.Template:
    """`source` compiled in the hardened sandbox, with the globals and filters chat templates are written against.

    ModelError if it does not compile, or if this jinja2 has known sandbox escapes."""
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


def template_locality(source: str) -> template_tail.Locality | None:
    """template_tail's proof for `source` (parsed as the sandbox parses it), or None where it cannot be given."""
    try:
        return template_tail.locality(_environment().parse(source))
    except TemplateError:
        return None


def render_budgeted(template: jinja2.Template, **context: Any) -> str:
    """One render of a compiled template with a fresh work budget; ModelError if it is unsafe or fails."""
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
    return render_budgeted(compile_template(source, where), messages=messages,
                           add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token)
