"""The controller's side of the Local server (app/local_server.py): started, stopped and restarted to match the
settings and the model loaded, and each request it serves shown in the statistics (a "server" row, never stored).

Mixed into ChatController (app/controller.py), whose settings, model state, host and signals it uses.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from .local_server import ServedTurn, ServerConfig
from .settings import save_settings
from .store import TurnRow

log = logging.getLogger(__name__)


class LocalServerHandling:
    """Keeps the Local server in step with the settings and the model, and reports what it serves."""

    @property
    def server_address(self) -> str | None:
        """Where the local server answers, while it is on."""
        return self.local_server.address

    @property
    def waiting_for_server(self) -> bool:
        """A window turn is queued behind a server request (its message waits, the window is not frozen)."""
        return self.server_busy and self._turn is not None and self._turn.prefill is None

    def _server_config(self) -> ServerConfig | None:
        """What the server should be running with now; None: it should be off."""
        s = self.settings
        info = self.model_info
        if not s.server.serve or self.model_state != "ready" or self._closing or info is None:
            return None
        if info.remote:
            return None  # a remote model's server is already a server: clients can use it directly
        return ServerConfig(s.server.server_port, s.server.server_key, str(info.model),
                            self.chat_defaults, s.chat.pin_system, s.chat.max_new_tokens)

    def _sync_server(self) -> None:
        """Starts, stops or restarts the local server to match the settings and the model."""
        want, server = self._server_config(), self.local_server
        if server.running:
            if server.config != want:
                server.stop()  # stopped follows once the port is free; then this runs again
                self.server_changed.emit()
            return
        session = self.host.worker.session
        if want is None or session is None:
            return
        try:
            server.start(session, want)
        except OSError as e:
            # Refused clearly, and the switch goes off: it would fail the same way at every start.
            self.notice.emit("error", f"The local server could not start: {e.strerror or e}. Choose another port "
                             "in Settings.", "settings")
            self.settings = replace(self.settings, server=replace(self.settings.server, serve=False))
            try:
                save_settings(self.data_dir, self.settings)
            except Exception as e2:  # QSettings reports no errors; be safe anyway
                log.warning("could not save the settings: %s", e2)
        self.server_changed.emit()

    def _on_server_request(self) -> None:
        self.server_busy = True
        self.server_changed.emit()

    def _on_served(self, served: ServedTurn) -> None:
        self.server_busy = False
        p, d = served.prefill, served.done
        if p is not None:
            # Its own kind of row: the request's prefill beside what its conversation's cache already held.
            row = TurnRow("server", p.new_tokens, p.ms, d.tokens if d else 0, d.ms if d else 0.0,
                          d.tok_s if d else 0.0, d.stop_reason if d else "stopped", (d or p).cache.to_dict(),
                          reused=p.cache.position - p.new_tokens)
            self.turns.append(row)
            self.server_turn.emit(row)
        self._on_cache(served.window_cache)  # the window's conversation is back in the cache: the bar shows it
        self.server_changed.emit()

    def _on_server_stopped(self, problem: str) -> None:
        self.server_busy = False
        if problem and not self._closing:
            self.notice.emit("warning", f"{problem[:1].upper()}{problem[1:]}.", "")
        self.server_changed.emit()
        if self._closing:
            self._close_when_done()
        elif not problem:
            self._sync_server()  # a restart (new port, key or model) starts once the old one has let go
