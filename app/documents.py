"""Documents attached to a message: which files are text, and how one becomes part of the message.

"Text-like" is decided by the content, not the name: valid UTF-8 (a BOM is allowed) with no NUL bytes, up to
MAX_DOCUMENT_BYTES. That takes .txt, .md, source code, .csv and .json alike and refuses images, archives,
PDFs and UTF-16 files with a reason the user can act on. No Qt here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_DOCUMENT_BYTES = 2 * 1024 * 1024  # 2 MB: far more than any window; the engine streams it through


class DocumentError(Exception):
    """A file that cannot be attached; the message says why, for the user."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    size: int  # bytes on disk


def size_text(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MB" if n >= 1024 * 1024 else f"{max(1, round(n / 1024))} KB" if n >= 1024 else f"{n} bytes"


def read_document(path: Path) -> Document:
    """The file as a Document, or DocumentError saying why it is not attached."""
    path = Path(path)
    name = path.name
    try:
        if not path.is_file():
            raise DocumentError(f"“{name}” is not a file, so it was not attached.")
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:  # before reading: a huge file is never loaded
            raise DocumentError(f"“{name}” is {size_text(size)}; Eddy attaches text files of up to "
                                f"{size_text(MAX_DOCUMENT_BYTES)}.")
        data = path.read_bytes()[: MAX_DOCUMENT_BYTES + 1]
    except OSError as e:
        raise DocumentError(f"Could not read “{name}”: {e.strerror or e}.") from e
    if len(data) > MAX_DOCUMENT_BYTES:  # it grew since the size was read
        raise DocumentError(f"“{name}” is larger than {size_text(MAX_DOCUMENT_BYTES)}; Eddy attaches text files "
                            f"of up to that size.")
    if b"\x00" in data:
        raise DocumentError(f"“{name}” is not a text file (it holds binary data), so it was not attached. "
                            "Eddy attaches text: plain text, Markdown, source code, CSV, JSON.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DocumentError(f"“{name}” is not UTF-8 text (byte {e.start:,} is not valid UTF-8), so it was not "
                            "attached. Save it as UTF-8 and attach it again.") from e
    return Document(name, text.replace("\r\n", "\n"), len(data))


def _fence(text: str) -> str:
    """A backtick fence longer than any run of backticks in `text`, so the document cannot close it early."""
    longest = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return "`" * max(3, longest + 1)


def as_message(documents: list[Document], question: str) -> str:
    """The user's message: each document as a fenced block under its name, then the question."""
    parts = []
    for doc in documents:
        fence = _fence(doc.text)
        lang = Path(doc.name).suffix.lstrip(".").lower()
        body = doc.text if doc.text.endswith("\n") or not doc.text else doc.text + "\n"
        parts.append(f"Document: {doc.name}\n{fence}{lang}\n{body}{fence}")
    if question.strip():
        parts.append(question.strip())
    return "\n\n".join(parts)
