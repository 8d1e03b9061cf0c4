"""Colours made from the palette, so a view looks right in light and dark themes alike."""
from __future__ import annotations

from PySide6.QtGui import QColor


def blend(a: QColor, b: QColor, t: float) -> QColor:
    """a mixed with b (t = share of b): palette-relative colours that work in light and dark themes."""
    return QColor(round(a.red() + (b.red() - a.red()) * t), round(a.green() + (b.green() - a.green()) * t),
                  round(a.blue() + (b.blue() - a.blue()) * t))
