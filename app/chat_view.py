"""The conversation: one bubble per message (replies rendered as Markdown) and the "left the window" marker.
A message with alternatives (replies written again, edits) has a ‹ 2/3 › switcher; its context menu edits it
or forks the chat there, and one of several alternatives can be deleted. What those do is the controller's: the view
only asks.

Renders a ChatModel and nothing else. Streaming text is coalesced: a reply is re-rendered at most every
REFRESH_MS, so a fast model (1000 tokens/s) costs the event loop a few renders a second, not a thousand.
"""
from __future__ import annotations

import json
import math
import re
import time
from typing import Callable

from PySide6.QtCore import QEvent, QRectF, QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (QBrush, QColor, QDesktopServices, QFontDatabase, QGuiApplication, QPainter, QPainterPath,
                           QPalette,
                           QTextBlockFormat, QTextCharFormat, QTextCursor, QTextFormat)
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QMenu, QPushButton, QScrollArea, QSizePolicy,
                               QTextBrowser, QToolButton, QVBoxLayout, QWidget)

from .elided_label import ElidedLabel
from .icons import icon
from .models import ChatModel, Message

REFRESH_MS = 40
# What a tool card's meta line says in each state (app/tool_cards.py).
CARD_STATES = {"asking": "asks to run", "running": "running…", "done": "done", "failed": "failed",
               "denied": "not allowed", "stopped": "stopped", "skipped": "not run"}
# A chat of more than LAZY_FROM messages opens with its last EAGER_MESSAGES built at once (more than a screen)
# and the older ones built above them in slices of about BUILD_SLICE_MS every BUILD_EVERY_MS: a bubble lays its
# text out when built, 3-10 ms each, so 200 at once froze the window for seconds. Each slice is followed by a
# layout pass of the whole column (5-10 ms at 200 bubbles), and the gap between slices keeps input and painting
# flowing (and leaves a core to the engine rebuilding the chat's cache meanwhile): the 200 are built in ~4 s.
LAZY_FROM = 24
EAGER_MESSAGES = 8
BUILD_SLICE_MS = 4
BUILD_EVERY_MS = 32
# A send appends two messages (the user's, the reply being written) in one slot; their two bubbles, built and
# laid out and painted in that one pass of the event loop, stalled it 20-30 ms. Appended messages get their
# bubbles a pass later, one bubble a pass, and the bubbles come from spares (one per role) built ahead,
# SPARE_AFTER_MS after the last was used, when the reply is streaming or done: a send fills them in.
SPARE_AFTER_MS = 1000
FLASH_MS = 1600  # how long a revealed message (a search hit) stays highlighted
COPIED_MS = 1500  # how long a code block's button says "Copied"
# A code block's heading line (language and Copy button) is a block of its own, marked with this property so
# it is never taken for code.
CODE_HEADER = QTextFormat.Property.UserProperty + 1
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown text, in order, as (language, code): the code exactly as written
    between the fences (CommonMark's rules: a fence of three or more ` or ~, closed by one at least as long of
    the same character; a block still open runs to the end, as a reply being written does)."""
    out: list[tuple[str, str]] = []
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        closing = re.compile(r"^ {0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        code: list[str] = []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            line = lines[i]
            # The opening fence's indent is taken off each line, as far as the line has it.
            code.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            i += 1
        if i >= len(lines) and code and code[-1] == "" and markdown.endswith("\n"):
            code.pop()  # still open: the text's last line break ends its last line, it is not a line of its own
        i += 1  # past the closing fence
        out.append((info.split()[0] if info else "", "\n".join(code)))
    return out


def short_time(t: float, now: float | None = None) -> str:
    """A message's time as the bubble shows it: the time of day, with the date when it is not today."""
    when, today = time.localtime(t), time.localtime(now if now is not None else time.time())
    if when[:3] == today[:3]:
        return time.strftime("%H:%M", when)
    if when.tm_year == today.tm_year:
        return f"{when.tm_mday} {time.strftime('%b %H:%M', when)}"
    return f"{when.tm_mday} {time.strftime('%b %Y %H:%M', when)}"


def message_tooltip(message: Message) -> str:
    """What hovering a message tells: when it was written and, for a reply, how fast and how long it was."""
    when = time.localtime(message.created)
    lines = [f"{'Sent' if message.role == 'user' else 'Written'} {time.strftime('%H:%M:%S', when)} on "
             f"{when.tm_mday} {time.strftime('%B %Y', when)}"]
    m = message.meta
    if message.streaming:
        lines.append("Being written…")
    elif message.role == "assistant" and m:
        lines.append(f"{m.get('tokens', 0):,} tokens at {m.get('tok_s', 0):.1f} tok/s (decode)")
        if m.get("prefill_tokens"):
            lines.append(f"Read {m['prefill_tokens']:,} new tokens first, in {m.get('prefill_ms', 0):,.0f} ms")
    if message.extra.get("model"):
        lines.append(f"By {message.extra['model']}")
    return "\n".join(lines)


def blend(a: QColor, b: QColor, t: float) -> QColor:
    """a mixed with b (t = share of b): palette-relative colours that work in light and dark themes."""
    return QColor(round(a.red() + (b.red() - a.red()) * t), round(a.green() + (b.green() - a.green()) * t),
                  round(a.blue() + (b.blue() - a.blue()) * t))


class MarkdownView(QTextBrowser):
    """A read-only text block as tall as its content (the scroll area around the chat does the scrolling).
    Each fenced code block of a Markdown text gets a heading line with its language and a Copy button."""

    code_copied = Signal(str)  # a code block's Copy button: exactly that block's code

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setOpenLinks(False)  # links open in the browser only when clicked, never inside the app
        self.anchorClicked.connect(self._open_link)
        # No background of its own: the bubble paints it (and the palette stays intact for the code shading).
        self.setAutoFillBackground(False)
        self.viewport().setAutoFillBackground(False)
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._markdown = True
        self._text = ""
        self._cut: tuple[int, str] | None = None
        self.extra_menu: Callable[[QMenu], None] | None = None  # the message's own actions, after Copy
        self.codes: list[str] = []  # the code of each code block shown, in order
        self.code_buttons: list[QToolButton] = []  # one per code block (kept, and reused as a reply streams)

    def contextMenuEvent(self, event) -> None:  # noqa: N802 (Qt API)
        menu = self.createStandardContextMenu(event.pos())
        if self.extra_menu is not None:
            menu.addSeparator()
            self.extra_menu(menu)
        menu.exec(event.globalPos())
        menu.deleteLater()

    def loadResource(self, kind: int, url: QUrl):  # noqa: N802 (Qt API)
        return None  # a reply must not make the app read files or fetch images

    @staticmethod
    def _open_link(url: QUrl) -> None:
        if url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)

    def set_content(self, text: str, markdown: bool, cut: tuple[int, str] | None = None) -> None:
        """Shows `text`; `cut` (plain text only) = (offset, note): the text before offset is dimmed and the
        note sits between it and the rest (where the model's view of a long message begins)."""
        if text == self._text and markdown == self._markdown and cut == self._cut and not self.document().isEmpty():
            return
        self._text, self._markdown, self._cut = text, markdown, cut
        if markdown:
            self.setMarkdown(text)
            self._style_code()
            self._head_code()
        elif cut is not None:
            self._show_cut(text, *cut)
        else:
            self.setPlainText(text)
        if not markdown:
            self.codes = []
        self._fit()

    def _show_cut(self, text: str, offset: int, note: str) -> None:
        pal = self.palette()
        base, fg = pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text)
        highlight = pal.color(QPalette.ColorRole.Highlight)
        self.clear()
        cursor = QTextCursor(self.document())
        normal = QTextCharFormat()
        dim = QTextCharFormat()
        dim.setForeground(QBrush(blend(fg, base, 0.5)))
        before, after = text[:offset], text[offset:]
        if before.endswith("\n"):
            before = before[:-1]  # the note's own block takes that line break
        if before:
            cursor.insertText(before, dim)
            cursor.insertBlock()
        note_block = QTextBlockFormat()
        note_block.setBackground(QBrush(blend(base, highlight, 0.18)))
        note_block.setTopMargin(4)
        note_block.setBottomMargin(4)
        cursor.setBlockFormat(note_block)
        note_fmt = QTextCharFormat()
        note_fmt.setForeground(QBrush(highlight))
        note_fmt.setFontWeight(700)
        cursor.insertText(note, note_fmt)
        cursor.insertBlock(QTextBlockFormat(), normal)
        cursor.insertText(after, normal)

    def _style_code(self) -> None:
        # Qt's Markdown import marks fenced blocks and inline code but gives them no background.
        pal = self.palette()
        shade = blend(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text), 0.10)
        doc = self.document()
        cursor = QTextCursor(doc)
        block = doc.begin()
        while block.isValid():
            if block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
                fmt = QTextBlockFormat()
                fmt.setBackground(QBrush(shade))
                fmt.setNonBreakableLines(False)  # wrap long lines: the bubble never scrolls sideways
                fmt.setLeftMargin(6)
                fmt.setRightMargin(6)
                cursor.setPosition(block.position())
                cursor.mergeBlockFormat(fmt)
            else:
                it = block.begin()
                while not it.atEnd():
                    frag = it.fragment()
                    if frag.charFormat().fontFixedPitch():
                        cf = QTextCharFormat()
                        cf.setBackground(QBrush(shade))
                        cursor.setPosition(frag.position())
                        cursor.setPosition(frag.position() + frag.length(), QTextCursor.MoveMode.KeepAnchor)
                        cursor.mergeCharFormat(cf)
                    it += 1
            block = block.next()

    def _head_code(self) -> None:
        """Puts a heading line over each code block: its language, and room for its Copy button (_place_buttons).
        The code copied is the Markdown's own, between the fences (the document's text of the block only if
        Qt found other code blocks than the fences, e.g. indented ones)."""
        doc = self.document()
        firsts: list[int] = []       # where each code block starts
        texts: list[list[str]] = []  # its lines as the document has them
        block, inside = doc.begin(), False
        while block.isValid():
            code = block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)
            if code and not inside:
                firsts.append(block.position())
                texts.append([])
            if code:
                texts[-1].append(block.text())
            inside = code
            block = block.next()
        sources = code_blocks(self._text)
        if len(sources) != len(firsts):
            sources = [("", "\n".join(lines)) for lines in texts]
        self.codes = [code for _, code in sources]
        pal = self.palette()
        base, fg = pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text)
        label = QTextCharFormat()
        label.setForeground(QBrush(blend(fg, base, 0.45)))
        cursor = QTextCursor(doc)
        for at, (language, _code) in reversed(list(zip(firsts, sources))):  # from the end: positions stay put
            code_fmt = doc.findBlock(at).blockFormat()
            head = QTextBlockFormat()
            head.setProperty(CODE_HEADER, True)
            head.setBackground(QBrush(blend(base, fg, 0.17)))
            head.setLeftMargin(6)
            head.setRightMargin(6)
            head.setTopMargin(max(code_fmt.topMargin(), 6.0))  # the gap above the block goes above its heading
            code_fmt.setTopMargin(0)
            cursor.setPosition(at)
            cursor.insertBlock(code_fmt)  # the code moves to the new block; the empty one left becomes the heading
            cursor.setPosition(at)
            cursor.setBlockFormat(head)
            cursor.insertText(language or "code", label)

    def _code_button(self, n: int) -> QToolButton:
        while len(self.code_buttons) <= n:
            b = QToolButton(self.viewport())
            b.setText("Copy")
            b.setIcon(icon("copy", size=14))
            b.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
            b.setAutoRaise(True)
            # Flat and without padding: it fits inside the heading line (a taller line would not be shaded whole).
            b.setStyleSheet("QToolButton { border: none; padding: 0px 4px; } QToolButton:hover { text-decoration: underline; }")
            b.setIconSize(QSize(12, 12))
            b.setCursor(Qt.CursorShape.PointingHandCursor)
            b.setToolTip("Copy this code block")
            b.setAccessibleName("Copy code")
            i = len(self.code_buttons)
            b.clicked.connect(lambda _checked=False, i=i: self._copy_code(i))
            self.code_buttons.append(b)
        return self.code_buttons[n]

    def _copy_code(self, n: int) -> None:
        if n < len(self.codes):
            self.code_copied.emit(self.codes[n])
            b = self.code_buttons[n]
            b.setText("Copied")  # the click did something: say so where the user looks
            self._place_buttons()  # a wider word: the button keeps its right edge
            QTimer.singleShot(COPIED_MS, b, lambda: (b.setText("Copy"), self._place_buttons()))  # b: not once gone

    def _place_buttons(self) -> None:
        """Each code block's Copy button at the right end of its heading line."""
        doc = self.document()
        n = 0
        block = doc.begin() if self.codes else doc.end()  # no code: no block to look at (a long reply has many)
        right = self.viewport().width() - doc.documentMargin()
        while block.isValid() and n < len(self.codes):
            if block.blockFormat().hasProperty(CODE_HEADER) and block.layout().lineCount():
                line = block.layout().lineAt(0)
                top = block.layout().position().y() + line.y()
                b = self._code_button(n)
                b.adjustSize()
                b.setFixedHeight(math.floor(line.height()))
                x = right - block.blockFormat().rightMargin() - b.width()
                b.move(int(x), int(top + (line.height() - b.height()) / 2))
                b.show()
                n += 1
            block = block.next()
        for b in self.code_buttons[n:]:
            b.hide()

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            for b in self.code_buttons:
                b.setIcon(icon("copy", size=14))  # icons are drawn in the palette's text colour

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._fit()

    def _fit(self, *_: object) -> None:
        doc = self.document()
        width = self.viewport().width()
        if doc.textWidth() != width:  # setting it lays the whole document out again, even to the same width
            doc.setTextWidth(width)
        margins = self.contentsMargins()
        height = math.ceil(doc.size().height()) + margins.top() + margins.bottom()
        if height != self.height():
            self.setFixedHeight(height)
        self._place_buttons()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(200, self.height())


def cut_offset(text: str, seen: int, total: int) -> int:
    """Roughly where in `text` the model's view begins: the same share of the characters as of the tokens
    (the exact place would need the tokenizer), moved back to its line's start when that is near."""
    if total <= 0:
        return 0
    offset = max(0, min(len(text), len(text) - round(len(text) * seen / total)))
    line = text.rfind("\n", 0, offset) + 1
    if offset - line <= 160:
        return line
    space = text.rfind(" ", 0, offset)
    return space + 1 if space >= 0 and offset - space < 40 else offset


class MessageWidget(QFrame):
    """One message: who, a little meta line, its alternatives (‹ 2/3 ›), a copy button and the text."""

    copy_requested = Signal(str)
    switch_requested = Signal(int)  # -1: the previous alternative, +1: the next
    edit_requested = Signal()
    regenerate_requested = Signal()
    fork_requested = Signal()
    delete_requested = Signal()
    tool_action = Signal(str)  # a tool card's button: "run", "always", "deny", "stop"

    def __init__(self, message: Message, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.role = message.role
        self.forgotten = False
        self.flashing = False
        self.setFocusPolicy(Qt.FocusPolicy.TabFocus)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 10)
        layout.setSpacing(2)
        header = QHBoxLayout()
        header.setSpacing(6)
        self.who = QLabel({"user": "You", "tool": "Tool"}.get(message.role, "Eddy"))
        font = self.who.font()
        font.setBold(True)
        self.who.setFont(font)
        self.time = QLabel()  # when it was written; the tooltip has the date and a reply's speed
        self.time.setObjectName("time")
        small = self.time.font()
        if small.pointSizeF() > 0:
            small.setPointSizeF(small.pointSizeF() * 0.85)
        self.time.setFont(small)
        self.meta = ElidedLabel()
        self.meta.setObjectName("meta")
        self.copy = QToolButton()
        self.copy.setAutoRaise(True)
        self.copy.setIcon(icon("copy", size=16))
        self.copy.setToolTip("Copy this message")
        self.copy.setAccessibleName("Copy message")
        self.copy.clicked.connect(lambda: self.copy_requested.emit(self._content))
        self.previous = self._arrow("‹", "Previous alternative", -1)
        self.position = QLabel()
        self.position.setObjectName("alternatives")
        self.next = self._arrow("›", "Next alternative", +1)
        header.addWidget(self.who)
        header.addWidget(self.time)
        header.addWidget(self.meta, 1)  # the room between the name and the buttons
        for w in (self.previous, self.position, self.next):
            header.addWidget(w)
        header.addWidget(self.copy)
        layout.addLayout(header)
        # A reasoning model's thinking: open while it thinks, folded once the reply is done (its length and
        # time on the button); a click opens or folds it, and that choice then stays.
        self.thinking_toggle = QToolButton()
        self.thinking_toggle.setObjectName("thinking")
        self.thinking_toggle.setAutoRaise(True)
        self.thinking_toggle.setCheckable(True)
        self.thinking_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.thinking_toggle.setAccessibleName("Show or hide the model's thinking")
        self.thinking_toggle.toggled.connect(self._show_thinking)
        self.thinking_toggle.clicked.connect(lambda: setattr(self, "_thinking_chosen", True))
        self.thinking = MarkdownView()
        self.thinking.setObjectName("thinkingText")
        self.thinking.setAccessibleName("The model's thinking")
        self._thinking_chosen = False
        quiet = self.thinking.palette()  # thinking reads as an aside: the placeholder's colour, in any theme
        quiet.setColor(QPalette.ColorRole.Text, quiet.color(QPalette.ColorRole.PlaceholderText))
        self.thinking.setPalette(quiet)
        layout.addWidget(self.thinking_toggle)
        layout.addWidget(self.thinking)
        self.thinking_toggle.hide()
        self.thinking.hide()
        # A tool card: the call (tool and arguments) and, while it asks or runs, what the user may do.
        self.call = ElidedLabel()
        self.call.setObjectName("toolCall")
        self.call.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.card_buttons = QHBoxLayout()
        self.card_buttons.setSpacing(6)
        self.tool_buttons: dict[str, QPushButton] = {}
        for action, text, tip in (("run", "Run", "Run this call once"),
                                  ("always", "Always allow", "Run this tool from now on without asking"),
                                  ("deny", "Don't run", "Tell the model the call was not allowed"),
                                  ("stop", "Stop", "Stop the call; the model is told it was stopped")):
            b = QPushButton(text)
            b.setToolTip(tip)
            b.clicked.connect(lambda _=False, a=action: self.tool_action.emit(a))
            self.card_buttons.addWidget(b)
            self.tool_buttons[action] = b
        self.card_buttons.addStretch(1)
        layout.addWidget(self.call)
        layout.addLayout(self.card_buttons)
        self.call.hide()
        for b in self.tool_buttons.values():
            b.hide()
        self.body = MarkdownView()
        self.body.setAccessibleName("Message text")
        self.body.extra_menu = self.fill_menu
        self.body.code_copied.connect(self.copy_requested)
        layout.addWidget(self.body)
        self._content = ""
        self._shown: tuple | None = None  # what set_message last showed
        self.alternatives = (1, 1)
        self._switcher: tuple[int, int, bool] | None = None  # what set_alternatives last showed
        self.locked = False
        self.set_message(message)

    def _arrow(self, text: str, name: str, step: int) -> QToolButton:
        b = QToolButton()
        b.setText(text)
        b.setAutoRaise(True)
        b.setAccessibleName(name)
        b.setToolTip(name)
        b.clicked.connect(lambda: self.switch_requested.emit(step))
        return b

    def fill_menu(self, menu: QMenu) -> None:
        """The message's own actions (its context menu, after the text's Copy)."""
        menu.addAction("Copy message", lambda: self.copy_requested.emit(self._content))
        if self.role == "user":
            edit = menu.addAction("Edit message…", self.edit_requested.emit)
            edit.setEnabled(not self.locked)
        elif self.role == "assistant":
            again = menu.addAction("Regenerate reply", self.regenerate_requested.emit)
            again.setEnabled(not self.locked)
        fork = menu.addAction("Fork chat here", self.fork_requested.emit)
        fork.setEnabled(not self.locked)
        if self.alternatives[1] > 1:  # with nothing to show in its place, a delete would end the chat here
            delete = menu.addAction("Delete this alternative…", self.delete_requested.emit)
            delete.setEnabled(not self.locked)

    def contextMenuEvent(self, event) -> None:  # noqa: N802 (Qt API)
        menu = QMenu(self)
        self.fill_menu(menu)
        menu.exec(event.globalPos())
        menu.deleteLater()

    def set_alternatives(self, position: int, count: int, locked: bool) -> None:
        """Which of `count` alternatives this message is (the switcher shows only when there are several);
        `locked`: a reply is being written, so nothing can be switched, edited or forked now."""
        before, self._switcher = self._switcher, (position, count, locked)
        self.alternatives, self.locked = (position, count), locked
        # Every render of every bubble asks again, and every send locks all of them: a long chat's send asked
        # 200 times. A bubble without alternatives shows no switcher, so locking changes nothing it shows.
        if before == self._switcher or (count == 1 and before is not None and before[1] == 1):
            return
        several = count > 1
        for w in (self.previous, self.position, self.next):
            w.setVisible(several)
        self.position.setText(f"{position}/{count}")
        self.position.setAccessibleName(f"Alternative {position} of {count}")
        self.previous.setEnabled(several and position > 1 and not locked)
        self.next.setEnabled(several and position < count and not locked)

    def set_message(self, message: Message, forgotten: bool = False, partly: bool = False,
                    seen: tuple[int, int] | None = None) -> None:
        """`seen`: for the message the model's window begins inside, (its tokens still seen, all its tokens)."""
        # Every window change renders every bubble again; most show just what they did (a 200-message chat
        # spent 30-60 ms of the GUI thread per send on that alone).
        shown = (message.content, message.streaming, dict(message.meta), message.created, forgotten, partly, seen,
                 json.dumps(message.extra, sort_keys=True), message.reasoning)
        if shown == self._shown:
            return
        self._shown = shown
        self._content = message.content
        self._set_thinking(message)
        self._set_card(message)
        self.forgotten = forgotten
        markdown = message.role == "assistant"  # a tool's result is shown as it came
        cut = None
        if seen and not markdown:
            cut = (cut_offset(message.content, *seen),
                   f"▼ The model's view begins about here: it still sees the last {seen[0]:,} of this message's "
                   f"{seen[1]:,} tokens. The text above has streamed through its window.")
        self.cut_note = cut[1] if cut else ""
        self.body.set_content(message.content, markdown=markdown, cut=cut)
        bits = []
        if message.role == "tool":
            bits.append(CARD_STATES.get(message.extra.get("state", ""), "")
                        + (f" in {message.extra['seconds']:.1f} s" if message.extra.get("seconds") is not None else ""))
        elif message.streaming:
            bits.append("writing…")
        elif message.meta:
            m = message.meta
            bits.append(f"{m.get('tokens', 0)} tokens · {m.get('tok_s', 0):.1f} tok/s")
            calls = [c.get("function", {}).get("name", "?") for c in message.extra.get("tool_calls") or []]
            if calls:
                bits.append("calls " + ", ".join(calls))
            if m.get("stop_reason") == "stopped":
                bits.append("stopped")
            elif m.get("stop_reason") == "length":
                bits.append("cut at max length")
        if forgotten:
            bits.append("out of the model's window")
        elif partly and seen:
            bits.append(f"partly out of the model's window: it sees the last {seen[0]:,} of {seen[1]:,} tokens")
        elif partly:
            bits.append("partly out of the model's window")
        self.meta.setText(" · ".join(bits))
        self.time.setText(short_time(message.created))
        # On the whole bubble: its text shows the tooltip too (the text view has none of its own).
        self.setToolTip(message_tooltip(message))
        who = "Your message" if self.role == "user" else "Reply from Eddy"
        self.setAccessibleName(who + (" (no longer seen by the model)" if forgotten else ""))
        self.setAccessibleDescription(message.content[:500])
        self._recolour()

    def _set_thinking(self, message: Message) -> None:
        text = message.reasoning
        self.thinking_toggle.setVisible(bool(text))
        if not text:
            self.thinking.hide()
            return
        still = message.streaming and not message.content
        seconds = message.extra.get("thinking_ms", 0) / 1e3
        label = "Thinking…" if still else (f"Thought for {seconds:.1f} s" if seconds else "Thought")
        self.thinking_toggle.setText(f"{'▾' if self.thinking_toggle.isChecked() else '▸'} {label} · "
                                     f"{len(text):,} characters")
        self.thinking.set_content(text, markdown=True)
        if not self._thinking_chosen:
            self.thinking_toggle.setChecked(still)  # open while it thinks, folded after
        self._show_thinking(self.thinking_toggle.isChecked())

    def _set_card(self, message: Message) -> None:
        card = message.role == "tool"
        self.call.setVisible(card)
        state = message.extra.get("state", "")
        for action, b in self.tool_buttons.items():
            b.setVisible(card and (state == "running") == (action == "stop") and state in ("asking", "running"))
        if card:
            call = f"{message.extra.get('tool', '?')}({message.extra.get('arguments', '')})"
            self.call.setText(call)
            self.call.setToolTip(call[:2000])
        # A card before its result, and a reply that only called tools, have no text to show.
        self.body.setVisible(bool(message.content) or message.streaming or not (card or message.extra.get("tool_calls")))

    def _show_thinking(self, shown: bool) -> None:
        self.thinking.setVisible(shown and bool(self._shown and self._shown[-1]))
        text = self.thinking_toggle.text()
        if text[:1] in "▸▾":
            self.thinking_toggle.setText(("▾" if shown else "▸") + text[1:])

    def cut_y(self) -> int:
        """Where the cut-off note sits inside this bubble, in its own coordinates (-1: it has none)."""
        if not self.cut_note:
            return -1
        found = self.body.document().find(self.cut_note)
        if found.isNull():
            return -1
        return self.body.mapTo(self, self.body.cursorRect(found).topLeft()).y()

    def flash(self) -> None:
        """Highlights the bubble for a moment (the message a search hit led to)."""
        self.flashing = True
        self.update()
        QTimer.singleShot(FLASH_MS, self, self._unflash)  # self: not once gone

    def _unflash(self) -> None:
        self.flashing = False
        self.update()

    def _recolour(self) -> None:
        pal = self.palette()
        dim = blend(pal.color(QPalette.ColorRole.Base), pal.color(QPalette.ColorRole.Text), 0.55)
        meta_pal = self.meta.palette()
        meta_pal.setColor(QPalette.ColorRole.WindowText, dim)
        self.meta.setPalette(meta_pal)
        self.time.setPalette(meta_pal)
        body_pal = self.body.palette()
        text = pal.color(QPalette.ColorRole.Text)
        body_pal.setColor(QPalette.ColorRole.Text, blend(text, pal.color(QPalette.ColorRole.Base), 0.4) if self.forgotten else text)
        self.body.setPalette(body_pal)
        self.update()

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self._recolour()

    def paintEvent(self, event) -> None:  # noqa: N802
        pal = self.palette()
        base = pal.color(QPalette.ColorRole.Base)
        if self.role == "user":
            fill = blend(base, pal.color(QPalette.ColorRole.Highlight), 0.14)
        else:
            fill = blend(base, pal.color(QPalette.ColorRole.Text), 0.04)
        if self.forgotten:
            fill = blend(fill, pal.color(QPalette.ColorRole.Window), 0.5)
        if self.flashing:
            fill = blend(fill, pal.color(QPalette.ColorRole.Highlight), 0.30)
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        path = QPainterPath()
        path.addRoundedRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5), 10, 10)
        painter.fillPath(path, fill)
        if self.hasFocus() or self.flashing:
            painter.setPen(pal.color(QPalette.ColorRole.Highlight))
            painter.drawPath(path)


class EvictionMarker(QWidget):
    """A rule with a caption: the messages above it have left the model's window."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Context window marker")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 4)
        self.label = QLabel()
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.label.setWordWrap(True)
        font = self.label.font()
        font.setPointSizeF(font.pointSizeF() * 0.9)
        self.label.setFont(font)
        layout.addWidget(self.label, 1)
        self.evicted = 0

    def set_counts(self, evicted: int, sinks: int, dropped: bool) -> None:
        self.evicted = evicted
        if evicted:
            text = f"▲ The model no longer sees the messages above: {evicted:,} tokens have left its window"
            if sinks:
                text += f" (it keeps the first {sinks} as attention sinks)"
        elif dropped:
            text = "▲ The messages above did not fit the model's window when this chat was reopened"
        else:
            text = ""
        self.label.setText(text)
        self.setAccessibleDescription(text)
        self._recolour()

    def _recolour(self) -> None:
        pal = self.label.palette()
        pal.setColor(QPalette.ColorRole.WindowText, self.palette().color(QPalette.ColorRole.Highlight))
        self.label.setPalette(pal)

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self._recolour()

    def paintEvent(self, event) -> None:  # noqa: N802
        painter = QPainter(self)
        pen = painter.pen()
        pen.setColor(self.palette().color(QPalette.ColorRole.Highlight))
        pen.setStyle(Qt.PenStyle.DashLine)
        painter.setPen(pen)
        y = self.height() // 2
        text_w = min(self.label.fontMetrics().horizontalAdvance(self.label.text()) + 24, self.width())
        gap = (self.width() - text_w) // 2
        if gap > 8:
            painter.drawLine(0, y, gap, y)
            painter.drawLine(self.width() - gap, y, self.width(), y)


class ChatView(QScrollArea):
    """Renders a ChatModel: bubbles in a column, the eviction marker between the forgotten and seen ones."""

    copy_requested = Signal(str)
    switch_requested = Signal(int, int)  # message index, step (-1 / +1)
    edit_requested = Signal(int)         # message index
    regenerate_requested = Signal(int)   # message index of the reply
    fork_requested = Signal(int)         # message index
    tool_action = Signal(int, str)       # a tool card's index and button ("run", "always", "deny", "stop")
    delete_requested = Signal(int)       # message index (one of several alternatives)

    def __init__(self, model: ChatModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setAccessibleName("Conversation")
        self.column = QWidget()
        self.column.setObjectName("chatColumn")
        self.layout_ = QVBoxLayout(self.column)
        self.layout_.setContentsMargins(16, 12, 16, 12)
        self.layout_.setSpacing(10)
        self.empty = QLabel("Start a conversation: type a message below and press Enter.\n"
                            "The statistics panel on the right shows what the model's cache is doing.")
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty.setWordWrap(True)
        self.empty.setEnabled(False)
        self.layout_.addWidget(self.empty)
        self.marker = EvictionMarker()
        self.marker.hide()
        self.layout_.addWidget(self.marker)
        self.layout_.addStretch(1)
        self.setWidget(self.column)
        self.widgets: list[MessageWidget] = []  # the bubbles of messages[top:], in order
        self.top = 0  # messages before it have no bubble yet: a long chat's older messages, built a slice a tick
        self._building = QTimer(self)
        self._building.setSingleShot(True)
        self._building.setInterval(BUILD_EVERY_MS)
        self._building.timeout.connect(self._build_slice)
        # While bubbles are built above what is read, the bubble at the view's top stays where it is on screen.
        self._anchor: tuple[MessageWidget, int] | None = None  # (that bubble, the view's offset from its top)
        self._anchored = False
        self._restoring = False  # the view is being put back at the anchor (not the user scrolling)
        self._unanchor = QTimer(self)  # until the layout has placed the last slice
        self._unanchor.setSingleShot(True)
        self._unanchor.setInterval(200)
        self._unanchor.timeout.connect(lambda: setattr(self, "_anchored", False))
        self.locked = False  # a reply is being written: no switching, editing or forking
        self._spares: dict[str, MessageWidget] = {}  # role -> a hidden bubble built ahead for the next append
        self._tail = QTimer(self)  # builds the bubbles of messages appended since, one a pass of the event loop
        self._tail.setSingleShot(True)
        self._tail.setInterval(0)
        self._tail.timeout.connect(self._build_tail)
        self._restock = QTimer(self)
        self._restock.setSingleShot(True)
        self._restock.timeout.connect(self._build_spares)
        self._dirty: set[int] = set()
        self._refresh = QTimer(self)
        self._refresh.setSingleShot(True)
        self._refresh.setInterval(REFRESH_MS)
        self._refresh.timeout.connect(self._flush)
        self._stick = True  # follow new text while the view is scrolled to the bottom
        self._revealing = -1  # a message being revealed: kept in view while the bubbles above settle their heights
        self._reveal_end = QTimer(self)
        self._reveal_end.setSingleShot(True)
        self._reveal_end.setInterval(FLASH_MS)
        self._reveal_end.timeout.connect(self._end_reveal)
        self.verticalScrollBar().rangeChanged.connect(self._follow)
        self.verticalScrollBar().valueChanged.connect(self._note_position)
        # Shown while the view is scrolled up (older messages being read): the way back to the end, where the
        # view follows a reply as it is written again. New text never moves the view while it shows.
        self.jump = QToolButton(self.viewport())
        self.jump.setObjectName("jumpToBottom")
        self.jump.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.jump.setAccessibleName("Scroll to the latest message")
        self.jump.setToolTip("Scroll to the latest message and follow the reply")
        self.jump.setCursor(Qt.CursorShape.PointingHandCursor)
        self.jump.setStyleSheet("QToolButton { background: palette(highlight); color: palette(highlighted-text); "
                                "border: none; border-radius: 13px; padding: 5px 14px; font-weight: bold; }")
        self.jump.clicked.connect(self.follow_again)
        self.jump.hide()
        model.changed.connect(self._update_jump)  # a reply starts or stops being written: the label says which
        model.reset.connect(self._rebuild)
        model.appended.connect(self._on_appended)
        model.changed.connect(self._on_changed)
        model.truncated.connect(self._on_truncated)
        model.replaced.connect(self._on_replaced)
        model.window_changed.connect(self._place_marker)
        self._rebuild()

    # --- model signals -----------------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        self._building.stop()
        self._tail.stop()
        for w in self.widgets:
            self.layout_.removeWidget(w)
            w.deleteLater()
        self.widgets = []
        self._dirty.clear()
        self._end_reveal()
        messages = self.model.messages
        self.top = len(messages) - EAGER_MESSAGES if len(messages) > LAZY_FROM else 0
        for message in messages[self.top:]:
            self._add_widget(message)
        self._stick = True
        self._place_marker()
        self.empty.setVisible(not messages)
        self._update_jump()
        QTimer.singleShot(0, self, self.scroll_to_bottom)
        if len(self._spares) < 2:
            self._restock.start(SPARE_AFTER_MS)
        if self.top:
            self._anchored = True
            self._building.start()

    def _build_slice(self) -> None:
        """Builds the bubbles of older messages above those built, for about BUILD_SLICE_MS."""
        start = time.perf_counter()
        below = self.top
        while self.top:
            self.top -= 1
            self._add_widget(self.model.messages[self.top], front=True)
            if (time.perf_counter() - start) * 1e3 >= BUILD_SLICE_MS:
                break
        if self.top:
            self._building.start()
        else:
            self._unanchor.start()
        for i in range(self.top, below):  # the new ones only: those below show their state already
            self._render(i)
        self._move_marker()

    def build_all(self) -> None:
        """Builds every bubble now (something needs an old message's bubble: a search hit, the marker)."""
        self._catch_up()
        self._building.stop()
        while self.top:
            self.top -= 1
            self._add_widget(self.model.messages[self.top], front=True)
        self._unanchor.start()
        self._place_marker()

    def _built_to(self) -> int:
        """Messages from here on were appended and have no bubble yet (a pass of the event loop later)."""
        return self.top + len(self.widgets)

    def _build_tail(self) -> None:
        index = self._built_to()
        if index >= len(self.model.messages):
            return
        self._add_widget(self.model.messages[index])
        # Only the new bubble: a message added at the end moves nobody else in or out of the window (the engine
        # reports that with window_changed), and rendering all 200 bubbles of a long chat cost a send 6 ms each.
        self._move_marker()
        self._render(index)
        if index + 1 < len(self.model.messages):
            self._tail.start()

    def _catch_up(self) -> None:
        """Builds the bubbles of appended messages now (before a change that counts on every bubble)."""
        while self._built_to() < len(self.model.messages):
            self._build_tail()
        self._tail.stop()

    def widget(self, index: int) -> MessageWidget | None:
        """Message `index`'s bubble (None: not built yet)."""
        return self.widgets[index - self.top] if self.top <= index < self.top + len(self.widgets) else None

    def _add_widget(self, message: Message, front: bool = False) -> None:
        spare = self._spares.pop(message.role, None)
        w = spare or self._new_bubble(message)
        if front:  # above the others, below the empty-chat label
            self.layout_.insertWidget(1, w)
            self.widgets.insert(0, w)
        else:  # before the stretch at the end; the marker moves between them
            self.layout_.insertWidget(self.layout_.count() - 1, w)
            self.widgets.append(w)
        if spare is not None:
            spare.set_message(message)
            spare.show()  # after the layout has it: never shown where it sat outside it
            self._restock.start(SPARE_AFTER_MS)
        if front:
            w.set_alternatives(*self.model.alternatives(self.top), self.locked)

    def _new_bubble(self, message: Message) -> MessageWidget:
        w = MessageWidget(message, self.column)
        w.copy_requested.connect(self.copy_requested)
        # By the widget, not a fixed index: the index is looked up when asked, after any change above it.
        w.switch_requested.connect(lambda step: self.switch_requested.emit(self._index(w), step))
        w.edit_requested.connect(lambda: self.edit_requested.emit(self._index(w)))
        w.regenerate_requested.connect(lambda: self.regenerate_requested.emit(self._index(w)))
        w.fork_requested.connect(lambda: self.fork_requested.emit(self._index(w)))
        w.tool_action.connect(lambda action: self.tool_action.emit(self._index(w), action))
        w.delete_requested.connect(lambda: self.delete_requested.emit(self._index(w)))
        return w

    def _build_spares(self) -> None:
        """Builds one missing spare bubble (5-7 ms), and the next one a little later: one would be a stall."""
        missing = [role for role in ("user", "assistant") if role not in self._spares]
        if not missing:
            return
        w = self._new_bubble(Message(missing[0], ""))
        # Shown once, where nothing sees it, and hidden: a first show polishes and lays out every child (2-3 ms a
        # bubble). Hidden, a child of the column outside its layout takes no room.
        w.setGeometry(0, -10 * self.column.height() - 1000, self.viewport().width(), 100)
        w.show()
        w.hide()
        self._spares[missing[0]] = w
        if len(missing) > 1:
            self._restock.start(BUILD_EVERY_MS)

    def _index(self, w: MessageWidget) -> int:
        return self.top + self.widgets.index(w)

    def _on_appended(self, index: int) -> None:
        self.empty.hide()
        self._stick = True
        if not self._tail.isActive():
            self._tail.start()

    def _on_changed(self, index: int) -> None:
        self._dirty.add(index)
        if not self._refresh.isActive():
            self._refresh.start()

    def _on_truncated(self, index: int) -> None:
        self._catch_up()
        self._drop_from(index)
        self.empty.setVisible(not self.model.messages)
        self._place_marker()

    def _on_replaced(self, index: int) -> None:
        # Another branch from `index` on: its bubbles replace those below, rendered once (not once per message),
        # and the view stays where it is, at the message whose alternative was chosen.
        self._catch_up()
        self._drop_from(index)
        for message in self.model.messages[index:]:
            self._add_widget(message)
        self.empty.setVisible(not self.model.messages)
        self._place_marker()

    def _drop_from(self, index: int) -> None:
        """Removes the bubbles of messages `index` on (building those above first if `index` has none yet)."""
        if index < self.top:
            self.build_all()
        for w in self.widgets[index - self.top:]:
            self.layout_.removeWidget(w)
            w.deleteLater()
        del self.widgets[index - self.top:]
        self._dirty = {i for i in self._dirty if i < index}

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        start = time.perf_counter()
        for i in sorted(dirty):
            self._render(i)
        # A long reply costs more to lay out each time: render less often so the event loop stays free
        # (at most a fifth of the time goes to re-rendering a streaming reply).
        spent_ms = (time.perf_counter() - start) * 1e3
        self._refresh.setInterval(max(REFRESH_MS, min(500, int(spent_ms * 4))))

    def flush(self) -> None:
        """Renders pending changes now (tests and screenshots call this instead of waiting a tick)."""
        self._catch_up()
        self._refresh.stop()
        self._flush()

    def _render(self, index: int) -> None:
        w = self.widget(index)
        if w is None:
            return  # built later, from the message as it is then
        forgotten = index < self.model.forgotten()
        w.set_message(self.model.messages[index], forgotten, self.model.partly_forgotten(index),
                      self.model.seen_of(index))
        w.set_alternatives(*self.model.alternatives(index), self.locked)

    def set_locked(self, locked: bool) -> None:
        """While a reply is being written nothing can switch branch, be edited or be forked."""
        self.locked = locked
        for i, w in enumerate(self.widgets, self.top):
            w.set_alternatives(*self.model.alternatives(i), locked)

    def _place_marker(self) -> None:
        self._move_marker()
        # Cheap for the bubbles whose window state did not change: set_message skips what it already shows.
        for i in range(self.top, self.top + len(self.widgets)):
            self._render(i)

    def _move_marker(self) -> None:
        n = self.model.forgotten()
        self.layout_.removeWidget(self.marker)
        # Above the first bubble only once every bubble above it is built.
        if 0 < n <= self.top + len(self.widgets) and (n > self.top or not self.top):
            self.marker.set_counts(self.model.evicted, self.model.sinks, self.model.left_out)
            # Index in the layout: the empty label first, then the message widgets.
            self.layout_.insertWidget(1 + n - self.top, self.marker)
            self.marker.show()
        else:
            self.marker.set_counts(0, 0, False)
            self.layout_.insertWidget(self.layout_.count() - 1, self.marker)
            self.marker.hide()

    # --- scrolling -----------------------------------------------------------------------------------------

    def _note_position(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick = value >= bar.maximum() - 24
        if self._anchored and not self._stick and not self._restoring:
            w = next((w for w in self.widgets if w.geometry().bottom() >= value), None)
            self._anchor = (w, value - w.geometry().top()) if w else None
        self._update_jump()

    def _follow(self, _min: int, _max: int) -> None:
        bar = self.verticalScrollBar()
        if self._revealing >= 0:
            self._show_revealed()
        elif self._stick:
            bar.setValue(bar.maximum())
        elif self._anchored and self._anchor:
            # Now, and again once the layout has moved the bubbles (their geometry may not be updated yet).
            self._restore_anchor()
            QTimer.singleShot(0, self, self._restore_anchor)
        self._update_jump()

    def _restore_anchor(self) -> None:
        if self._stick or not self._anchor or self._anchor[0] not in self.widgets:
            return
        w, offset = self._anchor
        self._restoring = True
        try:
            self.verticalScrollBar().setValue(w.geometry().top() + offset)
        finally:
            self._restoring = False

    def _update_jump(self, *_: object) -> None:
        bar = self.verticalScrollBar()
        up = not self._stick and bar.value() < bar.maximum() - 24
        if up:
            writing = bool(self.model.messages) and self.model.messages[-1].streaming
            text = "↓  Follow the reply" if writing else "↓  Latest message"
            if text != self.jump.text():
                self.jump.setText(text)
                self.jump.adjustSize()
            self._place_jump()
            self.jump.raise_()
        self.jump.setVisible(up)

    def _place_jump(self) -> None:
        v = self.viewport()
        self.jump.move((v.width() - self.jump.width()) // 2, v.height() - self.jump.height() - 12)

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        self._place_jump()

    def follow_again(self) -> None:
        """Back to the end of the chat, following the reply being written from there."""
        self._end_reveal()
        self._stick = True
        self.scroll_to_bottom()
        self._update_jump()

    def reveal(self, index: int) -> None:
        """Scrolls message `index` into view and highlights it for a moment (a search hit was opened)."""
        if not 0 <= index < len(self.model.messages):
            return
        if index < self.top:
            self.build_all()
        self._stick = False
        self._revealing = index
        self._reveal_end.start()
        self.flush()
        self.widget(index).flash()
        # Now and once the layout has run: the bubbles' heights settle after they are first shown.
        self._show_revealed()
        QTimer.singleShot(0, self, self._show_revealed)

    def _show_revealed(self) -> None:
        w = self.widget(self._revealing)
        if w is not None:
            # Its top a little below the view's top (the column is the bubbles' parent): a long message is
            # read from its start, and the one before it shows that this is the middle of a chat.
            top = w.geometry().top()
            self.verticalScrollBar().setValue(max(0, top - min(self.viewport().height() // 4, 80)))

    def _end_reveal(self) -> None:
        self._revealing = -1
        self._reveal_end.stop()

    def scroll_to_marker(self) -> None:
        """Shows where the model's view begins: the marker between messages, else the note inside a message."""
        self.build_all()
        if not self.marker.isHidden():
            self._stick = False
            self.ensureWidgetVisible(self.marker, 0, self.viewport().height() // 3)
            return
        for w in self.widgets:
            y = w.cut_y()
            if y >= 0:
                self._stick = False
                top = w.geometry().top() + y  # the column is the bubbles' parent
                self.verticalScrollBar().setValue(max(0, top - self.viewport().height() // 3))
                return

    def scroll_to_bottom(self) -> None:
        if self._revealing >= 0:
            return  # a search hit was opened: stay at it
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def marker_index(self) -> int:
        """Where the marker sits: the number of message bubbles above it (-1 when hidden)."""
        if self.marker.isHidden():
            return -1
        return self.top + self.layout_.indexOf(self.marker) - 1


def copy_to_clipboard(text: str) -> None:
    QGuiApplication.clipboard().setText(text)
