"""A controller killed with SIGKILL cannot stop its embedded Redis; the next start must stop that orphan
(it holds the socket and the append-only file) and keep the data it had acknowledged."""

from __future__ import annotations

from pathlib import Path

from controller.storage.redis_conn import PID_FILE, _running, make_client, start_embedded


def test_a_restart_stops_the_orphaned_server_and_keeps_its_data(tmp_path: Path) -> None:
    orphan, url = start_embedded(tmp_path)  # never stopped: as if its controller died
    pid = int((tmp_path / PID_FILE).read_text())
    assert _running(pid)
    client = make_client(url, 2.0)
    client.set("acknowledged", "42")
    client.close()

    server, url2 = start_embedded(tmp_path)
    try:
        assert not _running(pid), "the orphaned server is still running beside the new one"
        again = make_client(url2, 2.0)
        assert again.get("acknowledged") == "42"
        again.close()
    finally:
        server.stop()
        orphan._process = None  # already stopped by the restart


def test_a_stale_pid_file_is_ignored(tmp_path: Path) -> None:
    (tmp_path / PID_FILE).write_text("999999\n")  # no such process
    server, _ = start_embedded(tmp_path)
    server.stop()
