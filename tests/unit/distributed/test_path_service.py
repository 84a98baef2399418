"""The path service as `raytrm cluster head` starts it: a process of its own that answers with the token, stops when
`cluster stop` stops it, and stops by itself once Ray's head (a stand-in listener here) no longer answers, its pid
file gone each time. No Ray; loopback only."""

from __future__ import annotations

import socket
import time

import psutil
import pytest

from raytrm.distributed import path_client, path_service
from raytrm.distributed.launch import free_port
from raytrm.errors import UserError

pytestmark = pytest.mark.slow

TOKEN = "ab" * 32


@pytest.fixture
def files(tmp_path, monkeypatch):
    """The pid file and log in tmp_path, never this machine's /tmp/ray; a token file of mode 0600."""
    monkeypatch.setattr(path_service, "PID_FILE", tmp_path / "paths.pid")
    monkeypatch.setattr(path_service, "LOG_FILE", tmp_path / "paths.log")
    token = tmp_path / "auth_token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    return token


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_service_runs_until_stopped_or_until_rays_head_stops_answering(files):
    ray_head = socket.create_server(("127.0.0.1", 0))
    port = free_port()
    pid = path_service.start(port, files, f"127.0.0.1:{ray_head.getsockname()[1]}")
    try:
        assert path_service.running() == pid
        conn = path_client.open_service("127.0.0.1", port, TOKEN)
        assert all(not a.ip.startswith("127.") for a in path_client.ask_addresses(conn))
        conn.close()
        assert path_service.stop() and gone(pid) and not path_service.PID_FILE.exists()
        assert path_service.running() is None and not path_service.stop()

        pid = path_service.start(port, files, f"127.0.0.1:{ray_head.getsockname()[1]}")
        ray_head.close()  # Ray's head stops: the service follows within its watch's misses
        deadline = time.monotonic() + 30
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(pid) and not path_service.PID_FILE.exists()
    finally:
        ray_head.close()
        if not gone(pid):
            psutil.Process(pid).kill()


def test_a_service_that_cannot_listen_is_one_line(files):
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UserError) as refused:
            path_service.start(port, files, "127.0.0.1:9")
    assert str(refused.value).startswith(f"the path service did not start on port {port} (raytrm path service: ")
    assert str(refused.value).endswith("; free the port or give another --paths-port")
