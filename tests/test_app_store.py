"""The app's pieces without a window: the chat store, exports, settings and fitting a chat into the cache."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import conftest_app  # noqa: F401  (headless Qt platform; skips without PySide6)

import app.store_migrations as store_migrations
from app.settings import AppSettings, load_settings, save_settings
from app.store import DB_FILE, Store, StoreError, TurnRow
from app.transcript import to_json, to_markdown
from engine.config import BuildSettings

ROOT = Path(__file__).resolve().parents[1]


def test_store_round_trip(tmp_path):
    store = Store.open(tmp_path)
    conv = store.create_conversation("First")
    store.append_message(conv, 0, "user", "hi")
    reply = store.append_message(conv, 1, "assistant", "hello **there**")
    store.add_turn(conv, TurnRow("turn", 30, 4.5, 12, 100.0, 120.0, "eos", {"evicted": 0}, reply))
    store.rename_conversation(conv, "Renamed")
    store.close()

    again = Store.open(tmp_path)
    assert again.recovered_from is None
    assert [c.title for c in again.conversations()] == ["Renamed"]
    assert [(m.role, m.content) for m in again.messages(conv)] == [("user", "hi"), ("assistant", "hello **there**")]
    (turn,) = again.turns(conv)
    assert (turn.kind, turn.prefill_tokens, turn.tokens, turn.cache) == ("turn", 30, 12, {"evicted": 0})
    again.truncate_messages(conv, 1)
    assert len(again.messages(conv)) == 1
    again.delete_conversation(conv)
    assert again.conversations() == [] and again.turns(conv) == []
    assert again.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_damaged_database_is_moved_aside(tmp_path):
    (tmp_path / DB_FILE).write_bytes(b"this is not a database" * 200)
    store = Store.open(tmp_path)
    assert store.recovered_from is not None and store.recovered_from.exists()
    assert store.recovered_from.read_bytes().startswith(b"this is not a database")
    assert store.conversations() == []
    store.create_conversation("works")  # a fresh, usable database


def test_disk_full_is_a_clear_error(tmp_path):
    store = Store.open(tmp_path)
    conv = store.create_conversation("c")
    pages = store.conn.execute("PRAGMA page_count").fetchone()[0]
    store.conn.execute(f"PRAGMA max_page_count={pages}")  # the database can no longer grow: SQLITE_FULL
    with pytest.raises(StoreError, match="disk is full"):
        store.append_message(conv, 0, "user", "x" * 100_000)
    store.conn.execute("PRAGMA max_page_count=1073741823")
    store.replace_messages(conv, "c", [("user", "x"), ("assistant", "y")])
    assert [m.content for m in store.messages(conv)] == ["x", "y"]


# --- schema versions ---------------------------------------------------------------------------------------

# The schema exactly as release 1 (schema version 1) wrote it; a copy, so that a later edit of
# app.store_migrations cannot change what "an old database" means here.
V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, seq);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    message_id INTEGER REFERENCES messages(id) ON DELETE SET NULL,
    kind TEXT NOT NULL,
    prefill_tokens INTEGER NOT NULL,
    prefill_ms REAL NOT NULL,
    tokens INTEGER NOT NULL,
    decode_ms REAL NOT NULL,
    tok_s REAL NOT NULL,
    stop_reason TEXT NOT NULL,
    cache TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_by_conversation ON turns(conversation_id, id);
"""

V1_CHATS = {"Maths": [("user", "What is 2+2?"), ("assistant", "**4**")],
            "Poem; with 'quotes'": [("user", "a poem"), ("assistant", "roses\nare red"), ("user", "again")]}


def v1_database(data: Path, user_version: int = 1, journal: str = "wal") -> Path:
    """A database as release 1 left it: schema and version as its _connect wrote them, rows as its Store did."""
    data.mkdir(parents=True, exist_ok=True)
    db = data / DB_FILE
    conn = sqlite3.connect(str(db), isolation_level=None)
    conn.execute(f"PRAGMA journal_mode={journal}")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript(V1_SCHEMA)
    conn.execute(f"PRAGMA user_version={user_version}")
    for n, (title, messages) in enumerate(V1_CHATS.items()):
        conv = conn.execute("INSERT INTO conversations(title, created, updated) VALUES (?, ?, ?)",
                            (title, 100.0 + n, 200.0 + n)).lastrowid
        for seq, (role, content) in enumerate(messages):
            msg = conn.execute("INSERT INTO messages(conversation_id, seq, role, content, created) "
                               "VALUES (?, ?, ?, ?, ?)", (conv, seq, role, content, 150.0)).lastrowid
            if role == "assistant":
                conn.execute("INSERT INTO turns(conversation_id, message_id, kind, prefill_tokens, prefill_ms, "
                             "tokens, decode_ms, tok_s, stop_reason, cache, created) "
                             "VALUES (?, ?, 'turn', 30, 4.5, 12, 100.0, 120.0, 'eos', ?, 160.0)",
                             (conv, msg, json.dumps({"evicted": seq})))
    conn.close()
    return db


def assert_v1_chats(store: Store) -> None:
    convs = store.conversations()
    assert [c.title for c in convs] == list(reversed(V1_CHATS))  # most recently updated first
    for conv in convs:
        messages = V1_CHATS[conv.title]
        assert [(m.role, m.content) for m in store.messages(conv.id)] == messages
        turns = store.turns(conv.id)
        replies = [i for i, (role, _) in enumerate(messages) if role == "assistant"]
        assert [t.cache for t in turns] == [{"evicted": i} for i in replies]
        assert all(t.message_id is not None for t in turns)


def user_version(db: Path) -> int:
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


def columns(db: Path, table: str) -> list[str]:
    conn = sqlite3.connect(str(db))
    try:
        return [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
    finally:
        conn.close()


def with_steps(monkeypatch, *steps) -> int:
    """Appends test-only steps after the real ones, as a later Eddy would; returns the new version."""
    migrations = list(store_migrations.MIGRATIONS)
    for step in steps:
        migrations.append((len(migrations) + 1, step))
    monkeypatch.setattr(store_migrations, "MIGRATIONS", migrations)
    monkeypatch.setattr(store_migrations, "SCHEMA_VERSION", len(migrations))
    return len(migrations)


def test_a_fresh_database_is_at_the_current_version(tmp_path):
    store = Store.open(tmp_path)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == store_migrations.SCHEMA_VERSION
    assert store_migrations.SCHEMA_VERSION == store_migrations.MIGRATIONS[-1][0]
    assert store.conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    store.create_conversation("works")
    store.close()


# 1: what release 1 wrote. 0: release 1 set the version after creating the tables, in a separate transaction,
# so a crash in between left the tables with no version record.
@pytest.mark.parametrize("version", [1, 0])
def test_a_version_1_database_opens_with_its_chats(tmp_path, version):
    db = v1_database(tmp_path, user_version=version)
    store = Store.open(tmp_path)
    assert store.recovered_from is None
    assert_v1_chats(store)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == store_migrations.SCHEMA_VERSION
    store.close()
    assert not list(tmp_path.glob(f"{DB_FILE}.damaged-*"))
    assert user_version(db) == store_migrations.SCHEMA_VERSION


def test_an_old_database_is_migrated_once_keeping_its_chats(tmp_path, monkeypatch):
    runs = []

    def pin(conn: sqlite3.Connection) -> None:
        runs.append(conn.execute("PRAGMA user_version").fetchone()[0])
        conn.execute("ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")

    # A script with a ';' inside a string and inside a trigger: each must stay one statement.
    notes = """
        CREATE TABLE notes (text TEXT NOT NULL);
        INSERT INTO notes VALUES ('migrated; once');
        CREATE TRIGGER notes_forever BEFORE DELETE ON notes BEGIN SELECT RAISE(ABORT, 'kept; always'); END;
    """
    db = v1_database(tmp_path)
    version = with_steps(monkeypatch, notes, pin)
    for _ in range(2):
        store = Store.open(tmp_path)
        assert store.recovered_from is None
        assert_v1_chats(store)
        store.close()
    assert runs == [version - 1]  # ran once, on a database the step before had brought to its version
    assert user_version(db) == version
    assert "pinned" in columns(db, "conversations")
    store = Store.open(tmp_path)
    store.append_message(store.create_conversation("after the update"), 0, "user", "still writable")
    store.close()
    conn = sqlite3.connect(str(db))
    assert conn.execute("SELECT text FROM notes").fetchall() == [("migrated; once",)]
    with pytest.raises(sqlite3.IntegrityError, match="kept; always"):
        conn.execute("DELETE FROM notes")
    conn.close()


def test_a_fresh_database_runs_every_step(tmp_path, monkeypatch):
    version = with_steps(monkeypatch, "ALTER TABLE messages ADD COLUMN edited REAL")
    store = Store.open(tmp_path)
    conv = store.create_conversation("new")
    store.append_message(conv, 0, "user", "hi")
    store.close()
    assert user_version(tmp_path / DB_FILE) == version
    assert "edited" in columns(tmp_path / DB_FILE, "messages")


def _raises(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE conversations ADD COLUMN pinned INTEGER")
    raise ValueError("a bug in the step")


@pytest.mark.parametrize("step,why", [
    # The first statement works, the second fails: the first must be rolled back with it.
    ("ALTER TABLE conversations ADD COLUMN pinned INTEGER; INSERT INTO no_such_table VALUES (1);",
     "no such table"),
    # An IntegrityError is a DatabaseError but not damage: the file must not be moved aside.
    ("ALTER TABLE conversations ADD COLUMN pinned INTEGER; "
     "INSERT INTO conversations(id, title, created, updated) VALUES (1, 'x', 0, 0);", "UNIQUE constraint"),
    (_raises, "a bug in the step"),
])
def test_a_failing_step_leaves_the_old_version_intact(tmp_path, monkeypatch, step, why):
    db = v1_database(tmp_path)
    with monkeypatch.context() as m:
        version = with_steps(m, step)
        for _ in range(2):  # and keeps failing the same way, without damage piling up
            with pytest.raises(StoreError, match=rf"from schema version {version - 1} to {version}: .*{why}"):
                Store.open(tmp_path)
    assert user_version(db) == version - 1
    assert "pinned" not in columns(db, "conversations")
    assert not list(tmp_path.glob(f"{DB_FILE}.damaged-*"))
    store = Store.open(tmp_path)  # this version of Eddy, without the step, still has every chat
    assert store.recovered_from is None
    assert_v1_chats(store)
    store.close()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_a_database_from_a_newer_eddy_is_refused_and_left_untouched(tmp_path, journal):
    newer = store_migrations.SCHEMA_VERSION + 1
    v1_database(tmp_path, user_version=newer, journal=journal)
    before = _files(tmp_path)
    for _ in range(2):
        with pytest.raises(StoreError, match=rf"newer version of Eddy \(schema version {newer};.* up to "
                                             rf"{store_migrations.SCHEMA_VERSION}\)"):
            Store.open(tmp_path)
    assert _files(tmp_path) == before  # byte for byte, and nothing moved aside or left next to it


def test_the_app_says_why_it_cannot_open_a_newer_database(tmp_path):
    newer = store_migrations.SCHEMA_VERSION + 1
    v1_database(tmp_path, user_version=newer)
    before = _files(tmp_path)
    out = subprocess.run([sys.executable, "-m", "app", "--ask", "hi", "--data-dir", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "eddy-gui: error: The chat database" in out.stderr and f"schema version {newer}" in out.stderr
    assert "Traceback" not in out.stderr
    assert {name: data for name, data in _files(tmp_path).items() if name.startswith(DB_FILE)} == before


def test_exports():
    msgs = [("user", "What is 2+2?"), ("assistant", "**4**")]
    md = to_markdown("Maths", msgs)
    assert md.startswith("# Maths") and "**You:**" in md and "**4**" in md
    doc = json.loads(to_json("Maths", msgs, [TurnRow("turn", 10, 1.0, 2, 5.0, 400.0, "eos")], "tiny-random"))
    assert doc["messages"][1] == {"role": "assistant", "content": "**4**"}
    assert doc["turns"][0]["prefill_tokens"] == 10 and doc["model"] == "tiny-random"


def test_settings_round_trip_and_bad_values(tmp_path):
    s = AppSettings.of(window=60, sinks=4, dtype="f32", temperature=0.7, seed=3, system_prompt="Be brief.")
    save_settings(tmp_path, s)
    assert load_settings(tmp_path) == s
    assert s.needs_rebuild(AppSettings.of(window=61, sinks=4, dtype="f32")) and not s.needs_rebuild(
        AppSettings.of(window=60, sinks=4, dtype="f32", temperature=0.1))
    (tmp_path / "settings.ini").write_text("[General]\nwindow=-5\ndtype=f99\ntop_p=7\ntemperature=abc\nsinks=8\n")
    loaded = load_settings(tmp_path)  # bad values fall back to defaults, good ones are kept
    defaults = BuildSettings()
    build, sampling = loaded.build, loaded.chat.sampling
    assert (build.window, build.dtype, sampling.top_p, sampling.temperature, build.sinks) == (
        defaults.window, defaults.dtype, None, None, 8)


def _ini(path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


# What version 1 of the app wrote on every save: every field, sampling greedy unless the user changed it.
V1_FILE = """[General]
model=
sinks=4
window={window}
dtype=q8
device=cpu
max_chunk=512
system_prompt=
max_new_tokens=512
temperature={temperature}
top_k=0
top_p=1
repeat_penalty=1
repeat_last_n=64
seed=-1
"""


def test_version_1_settings_migrate_keeping_what_the_user_chose(tmp_path):
    from engine.run.generation import EDDY_CHAT_DEFAULTS

    (tmp_path / "settings.ini").write_text(V1_FILE.format(window=252, temperature=0.9))
    s = load_settings(tmp_path)
    # Chosen (different from version 1's defaults): kept. At the old greedy default: follows the model now.
    assert (s.build.window, s.chat.sampling.temperature) == (252, 0.9)
    o = s.chat.sampling
    assert (o.top_k, o.top_p, o.repeat_penalty, o.repeat_last_n, o.min_p) == (None,) * 5
    sampling = s.chat_settings().sampling
    assert (sampling.temperature, sampling.top_k, sampling.repeat_penalty) == (
        0.9, EDDY_CHAT_DEFAULTS["top_k"], EDDY_CHAT_DEFAULTS["repeat_penalty"])
    # The file now holds only what the user set, and says it is version 2: loading again changes nothing.
    assert _ini(tmp_path / "settings.ini") == {"window": "252", "temperature": "0.9", "settings_version": "2"}
    assert load_settings(tmp_path) == s


def test_untouched_version_1_settings_take_the_chat_defaults(tmp_path):
    from engine.run.generation import EDDY_CHAT_DEFAULTS

    (tmp_path / "settings.ini").write_text(V1_FILE.format(window=1020, temperature=0))
    s = load_settings(tmp_path)
    assert s == AppSettings()
    sampling = s.chat_settings().sampling
    assert {k: getattr(sampling, k) for k in EDDY_CHAT_DEFAULTS} == EDDY_CHAT_DEFAULTS
    assert _ini(tmp_path / "settings.ini") == {"settings_version": "2"}


def test_a_users_value_stays_theirs_when_the_model_changes(tmp_path):
    from engine.run.generation import chat_defaults

    qwen_like = chat_defaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20}, "generation_config.json")
    llama_like = chat_defaults({"temperature": 0.6, "top_p": 0.9}, "generation_config.json")
    s = AppSettings.of(top_k=5)
    save_settings(tmp_path, s)
    s = load_settings(tmp_path)
    a, b = s.chat_settings(qwen_like).sampling, s.chat_settings(llama_like).sampling
    assert a.top_k == b.top_k == 5  # the user's
    assert (a.temperature, a.top_p, b.temperature, b.top_p) == (0.7, 0.8, 0.6, 0.9)  # the model's
    # A value set to zero is still a choice (0 = off), stored and kept.
    save_settings(tmp_path, AppSettings.of(min_p=0.0))
    assert load_settings(tmp_path).chat.sampling.min_p == 0.0


def test_app_modules_do_not_import_torch():
    code = ("import sys, pkgutil, importlib, app\n"
            "for m in pkgutil.iter_modules(app.__path__):\n"
            "    if m.name != '__main__': importlib.import_module('app.' + m.name)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_logo_matches_resources():
    from app.icons import LOGO_SVG

    assert (ROOT / "resources" / "eddy.svg").read_text() == LOGO_SVG
