#!/usr/bin/env bash
# Takes the README screenshots of the real app on a virtual X screen (Xvfb) with a window manager (openbox),
# so they show what a user sees: window decorations, the dialog placed by the window manager, real fonts.
# Needs Debian's xvfb, openbox and the xcb libraries Qt's xcb plugin loads:
#   apt-get install xvfb xauth openbox libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-render-util0 \
#                   libxcb-xinerama0 libxcb-xkb1 libxkbcommon-x11-0 libxcb-cursor0 libxcb-shape0 libxcb-randr0
# Usage: docs/screenshots/take.sh [python]   (run from the repository root; default python: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
OUT=docs/screenshots
export QT_QPA_PLATFORM=xcb DISPLAY=:77
Xvfb :77 -screen 0 1600x1000x24 -nolisten tcp &
XVFB=$!
trap 'kill $WM $XVFB 2>/dev/null || true' EXIT
sleep 1
openbox &
WM=$!
sleep 1
# The main window mid-conversation on the default model, after the cache has evicted tokens.
"$PY" -m app.screenshots main-window "$OUT/main-window.png"
"$PY" -m app.screenshots main-window "$OUT/main-window-dark.png" --dark
# Settings over the loaded default model: the chat defaults in force, one value of the user's own (bold).
"$PY" -m app.screenshots settings "$OUT/settings.png"
# The first-run build dialog: an empty artefact cache, so the model has to be compiled.
EDDY_CACHE_DIR=$(mktemp -d) "$PY" -m app.screenshots first-run "$OUT/first-run.png" --model smollm2-135m-instruct
# Search (Ctrl+K) over a few stored chats, and a document of about six windows streamed through the window,
# answered, with the note where the model's view of it begins.
"$PY" -m app.screenshots search "$OUT/search.png"
"$PY" -m app.screenshots document "$OUT/document.png"
# A reply written three times, the second of them shown (‹ 2/3 ›), the cache moved to that branch (↻).
"$PY" -m app.screenshots alternatives "$OUT/alternatives.png"
# The Local server on, one openai request answered: its "server" row, the address in the status bar.
"$PY" -m app.screenshots local-server "$OUT/local-server.png" --model tiny-random
# A reply's code blocks with their Copy buttons, scrolled back to while the next reply streams ("Follow the reply").
"$PY" -m app.screenshots details "$OUT/details.png"
# A chat with its own system prompt from a preset, pinned in the sinks: the header and the cache bar's caption.
"$PY" -m app.screenshots system-prompt "$OUT/system-prompt.png" --model tiny-random --window 124
# A reasoning reply's thinking block opened (a stored chat: the default model does not think), and a tool card of
# the echo MCP server in tests/ (tools-card.png: asking to run; tools.png: after it ran and the reply followed).
"$PY" -m app.screenshots tools "$OUT/tools.png"
# The model picker open over GGUFs placed where a Hugging Face cache and Ollama keep them, and a cut one.
"$PY" -m app.screenshots models "$OUT/models.png"
