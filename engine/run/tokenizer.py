"""Tokenizer for the runtime: `tokenizers` + the chat template, no torch/transformers.

The template renders in engine/run/template_sandbox.py; streamed ids turn back into text in
engine/run/stream_decoder.py.

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
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer as _HFTokenizer

from ..errors import ModelError
from . import template_tail
from .reasoning import THINK_OPEN
from .stream_decoder import StreamDecoder
from .template_sandbox import compile_template, render_budgeted, template_locality

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
        self._template = compile_template(self._template_source, where)
        self._bos_token: str | None = cfg.get("bos_token")
        self._eos_token: str | None = cfg.get("eos_token")
        self._add_bos: bool = cfg.get("add_bos_token", False)
        # Tail rendering (see template_tail): the proof for this template, the chats it may be used for, and
        # how many of its answers are still to be checked against a full render.
        self._locality = template_locality(self._template_source)
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
        return render_budgeted(self._template, **self._extras, messages=messages,
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
