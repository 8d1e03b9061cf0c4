"""The chat store under faults: kill -9 mid-save, two processes on one data folder (writing, or both updating
an old database's schema), a database another process holds locked, text SQLite cannot take. (A damaged file
being moved aside, and schema versions in one process, are in test_app_store.py.)

Real subprocesses write through app.store.Store; each prints an ack after every commit returns, so the test
knows exactly which messages were committed when it kills the writer.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.store import DB_FILE, Store, StoreError
from app.store_migrations import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from app.store import Store
    data, tag, count, size = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = Store.open(data)
    conv = store.create_conversation(tag)
    print("conv", conv, flush=True)
    for i in range(count):
        body = f"{{tag}} message {{i}} " + "x" * size
        if i % 10 == 9:  # now and then a whole chat rewritten in one transaction, as the app's catch-up does
            store.replace_messages(conv, tag, [("user", f"{{tag}} message {{j}} " + "x" * size) for j in range(i + 1)])
        else:
            store.append_message(conv, i, "user", body)
        print("ack", i, flush=True)
    print("done", flush=True)
""").format(root=str(ROOT))


def writer(data: Path, tag: str, count: int, size: int = 200) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(data), tag, str(count), str(size)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def integrity(data: Path) -> str:
    conn = sqlite3.connect(str(data / DB_FILE))
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def check_messages(store: Store, conv: int, tag: str, at_least: int, size: int) -> int:
    """Messages of `conv` are exactly `tag` 0..n-1 in order with n >= at_least; returns n."""
    msgs = store.messages(conv)
    assert len(msgs) >= at_least, f"{tag}: {len(msgs)} messages on disk but {at_least} were acknowledged"
    for i, m in enumerate(msgs):
        assert (m.seq, m.role, m.content) == (i, "user", f"{tag} message {i} " + "x" * size)
    return len(msgs)


@pytest.mark.parametrize("size,kill_after", [(200, 40), (200_000, 12), (20, 230)])
def test_kill_9_mid_save_loses_no_committed_message(tmp_path, size, kill_after):
    proc = writer(tmp_path, "solo", 100_000, size)
    conv, acked = None, -1
    for line in proc.stdout:
        word, *rest = line.split()
        if word == "conv":
            conv = int(rest[0])
        elif word == "ack":
            acked = int(rest[0])
            if acked + 1 >= kill_after:
                break
    time.sleep(0.003 * (kill_after % 7))  # land somewhere inside the next write
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    for line in proc.stdout:  # acks the writer printed before it died, still in the pipe
        word, *rest = line.split()
        if word == "ack":
            acked = int(rest[0])
    assert "done" not in line, "the writer finished before it was killed"
    assert conv is not None and acked + 1 >= kill_after
    assert integrity(tmp_path) == "ok"
    store = Store.open(tmp_path)
    assert store.recovered_from is None, "a database left by a killed writer was treated as damaged"
    n = check_messages(store, conv, "solo", acked + 1, size)
    assert n <= acked + 2  # at most the write that was in flight when the writer died
    store.append_message(conv, n, "user", "after the crash")  # still writable
    store.close()


def test_two_processes_writing_one_data_folder(tmp_path):
    Store.open(tmp_path).close()  # both find an existing database, as two app instances would
    procs = {tag: writer(tmp_path, tag, 300, 500) for tag in ("first", "second")}
    convs = {}
    for tag, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert out.splitlines()[-1] == "done" and "Traceback" not in err
        convs[tag] = int(out.split()[1])
    assert integrity(tmp_path) == "ok"
    store = Store.open(tmp_path)
    assert store.recovered_from is None
    for tag, conv in convs.items():
        assert check_messages(store, conv, tag, 300, 500) == 300
    assert sorted(c.title for c in store.conversations()) == ["first", "second"]


HOLDER = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("UPDATE conversations SET title = title")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    conn.execute("COMMIT")
""")


def test_a_database_locked_by_another_process_is_not_treated_as_damaged(tmp_path):
    # Another instance holding a write transaction longer than SQLite's busy timeout used to make Store.open
    # read "database is locked" as damage and move the healthy database (and its WAL) aside.
    store = Store.open(tmp_path)
    conv = store.create_conversation("kept")
    store.append_message(conv, 0, "user", "precious")
    store.close()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / DB_FILE), "6"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.perf_counter()
        second = Store.open(tmp_path)  # opening an existing database only reads: no wait, no error
        assert time.perf_counter() - start < 3
        assert second.recovered_from is None
        assert [m.content for m in second.messages(conv)] == ["precious"]
        second.close()
        assert not list(tmp_path.glob(f"{DB_FILE}.damaged-*")), "a locked, healthy database was moved aside"
    finally:
        holder.wait(timeout=60)
    again = Store.open(tmp_path)
    assert again.recovered_from is None
    assert [m.content for m in again.messages(conv)] == ["precious"]


def test_writes_while_another_process_holds_the_lock_are_a_clear_error_then_work(tmp_path):
    store = Store.open(tmp_path)
    conv = store.create_conversation("c")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / DB_FILE), "8"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreError, match="locked by another program"):
            store.append_message(conv, 0, "user", "waits, then gives up")
    finally:
        holder.wait(timeout=60)
    store.append_message(conv, 0, "user", "now it fits")
    assert [m.content for m in store.messages(conv)] == ["now it fits"]


def test_text_sqlite_cannot_encode_is_saved_as_valid_text(tmp_path):
    # Lone surrogates (text decoded with surrogateescape) made sqlite3 raise UnicodeEncodeError, which is not a
    # StoreError, so the caller's error handling missed it.
    store = Store.open(tmp_path)
    conv = store.create_conversation("title \udcff")
    store.append_message(conv, 0, "user", "bad \ud800 pair \ud83d\ude00 nul \x00 end")
    store.replace_messages(conv, "t \ud800", [("user", "a \udc80"), ("assistant", "ok")])
    store.rename_conversation(conv, "renamed \udfff")
    store.close()
    again = Store.open(tmp_path)
    assert [m.content for m in again.messages(conv)] == ["a \ufffd", "ok"]
    assert again.conversation(conv).title == "renamed \ufffd"
    assert integrity(tmp_path) == "ok"


def _filled(tmp_path: Path, n: int = 400) -> Path:
    store = Store.open(tmp_path)
    conv = store.create_conversation("full")
    for i in range(n):
        store.append_message(conv, i, "user", f"message {i} " + "y" * 300)
    store.close()
    db = tmp_path / DB_FILE
    assert not Path(f"{db}-wal").exists() or Path(f"{db}-wal").stat().st_size == 0  # checkpointed on close
    return db


def _cut(db: Path) -> None:
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])


def _scribble(db: Path) -> None:
    data = bytearray(db.read_bytes())
    page = 4096
    for at in range(2 * page, len(data), 7 * page):  # trash a few b-tree pages, keep the header
        data[at: at + 512] = os.urandom(512)
    db.write_bytes(bytes(data))


def _garbage_wal(db: Path) -> None:
    Path(f"{db}-wal").write_bytes(os.urandom(64 * 1024))


def _header(db: Path) -> None:
    data = bytearray(db.read_bytes())
    data[:16] = b"not sqlite hdr\0\0"
    db.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,kept", [(_cut, False), (_scribble, False), (_header, False), (_garbage_wal, True)])
def test_damaged_database_files_are_moved_aside_or_survive(tmp_path, damage, kept):
    db = _filled(tmp_path)
    damage(db)
    store = Store.open(tmp_path)  # never raises for a damaged file
    if kept:  # SQLite ignores WAL frames whose checksums do not match: nothing is lost
        assert store.recovered_from is None
        assert len(store.messages(store.conversations()[0].id)) == 400
    else:
        assert store.recovered_from is not None and store.recovered_from.exists(), "damage went unnoticed"
        assert store.conversations() == []  # a fresh database...
        store.create_conversation("new")  # ...that works
        assert integrity(tmp_path) == "ok"
    store.close()


# Eddy at a later schema: one extra step, slow enough that a second instance opens the file meanwhile.
MIGRATOR = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from pathlib import Path
    import app.store as store
    import app.store_migrations as migrations

    def step(conn):
        conn.execute("CREATE TABLE runs (pid INTEGER NOT NULL)")
        conn.execute("INSERT INTO runs VALUES (?)", (os.getpid(),))
        print("migrating", flush=True)
        time.sleep(float(sys.argv[2]))

    migrations.MIGRATIONS = [*migrations.MIGRATIONS, (migrations.SCHEMA_VERSION + 1, step)]
    migrations.SCHEMA_VERSION += 1
    s = store.Store.open(Path(sys.argv[1]))
    print("opened", len(s.conversations()), flush=True)
""").format(root=str(ROOT))


def test_two_instances_opening_an_old_database_migrate_it_once(tmp_path):
    store = Store.open(tmp_path)
    store.append_message(store.create_conversation("old"), 0, "user", "kept")
    store.close()
    first = subprocess.Popen([sys.executable, "-c", MIGRATOR, str(tmp_path), "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "migrating"  # it holds the write lock now, mid-step
    # The second reads the old version, waits for the lock, and must then find the step done.
    second = subprocess.Popen([sys.executable, "-c", MIGRATOR, str(tmp_path), "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out2, err2 = second.communicate(timeout=60)
    out1, err1 = first.communicate(timeout=60)
    assert (first.returncode, second.returncode) == (0, 0), err1[-2000:] + err2[-2000:]
    assert out1.split() == out2.split() == ["opened", "1"]
    conn = sqlite3.connect(str(tmp_path / DB_FILE))
    assert conn.execute("SELECT pid FROM runs").fetchall() == [(first.pid,)]
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    conn.close()
