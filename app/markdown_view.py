"""A message's text as Qt renders Markdown: as tall as its content, links opened only in the browser, and each
fenced code block under a heading line with its language and a Copy button that copies the fence's code exactly.
"""
from __future__ import annotations

import math
import re
from typing import Callable

from PySide6.QtCore import QEvent, QSize, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (QBrush, QDesktopServices, QPalette, QTextBlockFormat, QTextCharFormat, QTextCursor,
                           QTextFormat)
from PySide6.QtWidgets import QFrame, QMenu, QSizePolicy, QTextBrowser, QToolButton, QWidget

from .colours import blend
from .icons import icon

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
