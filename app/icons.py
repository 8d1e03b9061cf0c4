"""Icons drawn as small SVGs in the text colour of the current palette, so they follow light and dark themes.

They live in the code (not in resources/) so an installed package never misses them; resources/eddy.svg is
the same logo for desktop integration, and a test keeps the two equal.
"""
from __future__ import annotations

from functools import lru_cache

from PySide6.QtCore import QByteArray, QRectF, Qt
from PySide6.QtGui import QColor, QGuiApplication, QIcon, QPainter, QPalette, QPixmap
from PySide6.QtSvg import QSvgRenderer

_STROKE = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" stroke="{color}" '
           'stroke-width="2" stroke-linecap="round" stroke-linejoin="round">{body}</svg>')

_BODIES = {
    "send": '<path d="M4 12 20 4l-4 16-4-6-8-2z"/><path d="M12 14 20 4"/>',
    "stop": '<rect x="6" y="6" width="12" height="12" rx="2"/>',
    "regenerate": '<path d="M20 11a8 8 0 1 0-2.3 5.7"/><path d="M20 4v7h-7"/>',
    "edit": '<path d="M4 20h4L19 9l-4-4L4 16z"/><path d="m13 7 4 4"/>',
    "copy": '<rect x="8" y="8" width="12" height="12" rx="2"/><path d="M16 8V5a1 1 0 0 0-1-1H5a1 1 0 0 0-1 1v10a1 1 0 0 0 1 1h3"/>',
    "new": '<path d="M12 5v14M5 12h14"/>',
    "settings": '<path d="M4 7h10M18 7h2M4 17h4M12 17h8"/><circle cx="16" cy="7" r="2"/><circle cx="10" cy="17" r="2"/>',
    "stats": '<path d="M4 20V10M10 20V4M16 20v-7M22 20H2"/>',
    "sidebar": '<rect x="3" y="4" width="18" height="16" rx="2"/><path d="M9 4v16"/>',
    "close": '<path d="M6 6l12 12M18 6 6 18"/>',
    "attach": '<path d="M20 11.5 12.5 19a5 5 0 0 1-7-7L13 4.5a3.5 3.5 0 0 1 5 5L10.5 17a2 2 0 0 1-3-3L14 7.5"/>',
}

LOGO_SVG = """<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 64 64">
  <defs>
    <linearGradient id="bg" x1="0" y1="0" x2="1" y2="1">
      <stop offset="0" stop-color="#2f80ed"/>
      <stop offset="1" stop-color="#12b3a8"/>
    </linearGradient>
  </defs>
  <rect x="2" y="2" width="60" height="60" rx="14" fill="url(#bg)"/>
  <path d="M52 30A20 20 0 0 1 12 30A16 16 0 0 1 44 30A12 12 0 0 1 20 30A8 8 0 0 1 36 30A4 4 0 0 1 28 30"
        fill="none" stroke="#ffffff" stroke-width="4.5" stroke-linecap="round"/>
</svg>
"""


# Each chat bubble asks for the same copy icon: rendering the SVG every time cost a 200-message chat ~0.3 s
# of its opening. The SVG text holds the colour, so a palette change still gets fresh pixmaps.
@lru_cache(maxsize=128)
def _render(svg: str, size: int) -> QPixmap:
    renderer = QSvgRenderer(QByteArray(svg.encode()))
    ratio = 2.0  # crisp on high-DPI screens, downscaled elsewhere
    pix = QPixmap(int(size * ratio), int(size * ratio))
    pix.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pix)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter, QRectF(0, 0, pix.width(), pix.height()))
    painter.end()
    pix.setDevicePixelRatio(ratio)
    return pix


def icon(name: str, color: QColor | None = None, size: int = 20) -> QIcon:
    """A line icon in `color` (default: the palette's text colour, dimmed for the disabled state)."""
    palette = QGuiApplication.palette()
    color = color or palette.color(QPalette.ColorRole.ButtonText)
    disabled = palette.color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.ButtonText)
    out = QIcon()
    out.addPixmap(_render(_STROKE.format(color=color.name(), body=_BODIES[name]), size), QIcon.Mode.Normal)
    out.addPixmap(_render(_STROKE.format(color=disabled.name(), body=_BODIES[name]), size), QIcon.Mode.Disabled)
    return out


def logo(size: int = 64) -> QIcon:
    out = QIcon()
    for s in (16, 24, 32, 48, 64, 128, 256):
        out.addPixmap(_render(LOGO_SVG, s))
    return out
