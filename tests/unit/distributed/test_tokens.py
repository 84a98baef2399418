"""Cluster token files: made 0600, refused with the chmod to run where other users could read them, every bad file
one line that never shows the token; a local Ray finds its token private (no Ray started, except the one slow
test)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from raytrm.distributed import tokens
from raytrm.errors import UserError

TOKEN = "5f" * 32


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def private(path, data: bytes | str = TOKEN, mode: int = 0o600):
    """path holding data, mode 0600 unless told: as `scp` and `chmod 600` leave a copied token."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


def open_to_others(path, found: int) -> str:
    return (
        f"the cluster token at {path} is open to other users (mode {found:04o}): anyone on this Mac could read it and "
        f"drive the cluster; run `chmod 600 {path}` and try again"
    )


@pytest.fixture
def environ(monkeypatch):
    """A private copy of the environment without Ray's knobs: what the functions set must not reach other tests."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("RAY_")})
    return os.environ


def test_the_head_token_is_created_private_and_kept(tmp_path):
    token = tmp_path / ".ray" / "auth_token"
    assert tokens.ensure_token(token) is True
    text = token.read_text()
    assert mode(token) == 0o600 and len(text) == 64 and int(text, 16) >= 0
    assert tokens.ensure_token(token) is False and token.read_text() == text  # joined nodes keep working


@pytest.mark.parametrize("found", [0o644, 0o640, 0o604, 0o666, 0o620, 0o602, 0o777, 0o444, 0o060])
def test_a_token_other_users_could_read_or_replace_is_refused_with_the_chmod_to_run(tmp_path, found):
    token = private(tmp_path / "auth_token", TOKEN + "\n", found)
    with pytest.raises(UserError) as refused:
        tokens.read_token(token)
    assert str(refused.value) == open_to_others(token, found)
    assert mode(token) == found and token.read_text() == TOKEN + "\n"  # left as it was: the user runs the chmod


@pytest.mark.parametrize("kept", [0o600, 0o400, 0o700])
def test_a_token_only_its_owner_can_touch_is_read(tmp_path, kept):
    token = private(tmp_path / "auth_token", TOKEN, kept)
    assert tokens.read_token(token) == TOKEN and mode(token) == kept


def test_the_head_refuses_its_own_token_open_to_others_as_every_reader_does(tmp_path):
    token = private(tmp_path / "auth_token", TOKEN, 0o644)  # as Ray writes its own
    with pytest.raises(UserError) as refused:
        tokens.ensure_token(token)
    assert str(refused.value) == open_to_others(token, 0o644)
    assert mode(token) == 0o644 and token.read_text() == TOKEN


def test_a_missing_token_says_how_to_bring_it(tmp_path):
    with pytest.raises(UserError) as refused:
        tokens.read_token(tmp_path / "missing", head="10.0.0.1")
    missing = tmp_path / "missing"
    assert str(refused.value) == (
        f"no cluster token at {missing}: copy the head's ~/.ray/auth_token here (`scp 10.0.0.1:.ray/auth_token "
        f"{missing} && chmod 600 {missing}`), or pass --token-file"
    )
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"^no cluster token at .*dangling"):
        tokens.read_token(tmp_path / "dangling")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "is empty"),
        (b"\n  \n\t", "is empty"),
        (b"ab12\ncd34\n", "holds 2 lines"),
        (b"ab12\r\ncd34", "holds 2 lines"),
        (b"ab 12", "holds spaces or control characters"),
        (b"ab\x0012", "holds spaces or control characters"),
        (b"\xff\xfe" + TOKEN.encode(), "is not text (bytes other than ASCII)"),
        ("caf\u00e9".encode(), "is not text (bytes other than ASCII)"),
        (b"a" * 1025, "holds a line of 1025 characters (at most 1024)"),
        (b"a" * 5000, "holds more than 4096 bytes"),
    ],
)
def test_a_token_file_that_is_not_a_token_is_one_line_that_does_not_show_it(tmp_path, content, problem):
    token = private(tmp_path / "auth_token", content)
    with pytest.raises(UserError) as refused:
        tokens.read_token(token, head="10.0.0.1")
    assert str(refused.value) == (
        f"the cluster token at {token} {problem}, expected one line of letters and digits; copy the head's (`scp "
        f"10.0.0.1:.ray/auth_token {token} && chmod 600 {token}`)"
    )
    assert token.read_bytes() == content and mode(token) == 0o600  # never rewritten
    assert "ab12" not in str(refused.value) and "cd34" not in str(refused.value)


def test_a_token_of_a_single_line_with_spaces_around_is_read_as_ray_reads_it(tmp_path):
    token = private(tmp_path / "auth_token", f"  {TOKEN}  \n\n")
    assert tokens.read_token(token) == TOKEN


def test_a_token_that_is_a_directory_a_fifo_or_unreadable_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    with pytest.raises(UserError, match=r"^the cluster token at .*dir is a directory, expected a file holding the"):
        tokens.read_token(tmp_path / "dir")
    os.mkfifo(tmp_path / "fifo")  # reading it would wait for a writer forever
    with pytest.raises(UserError, match=r"^the cluster token at .*fifo is not a regular file, expected a file"):
        tokens.read_token(tmp_path / "fifo")
    private(tmp_path / "file", "")
    with pytest.raises(UserError, match=r"^cannot read the cluster token at .*file/token \(Not a directory\); copy"):
        tokens.read_token(tmp_path / "file" / "token")

    def unreadable(*args, **kwargs):  # as root, mode 000 is still readable: the refusal is faked
        raise PermissionError(errno.EACCES, "Permission denied")

    token = private(tmp_path / "auth_token")
    monkeypatch.setattr(tokens, "open", unreadable, raising=False)
    with pytest.raises(UserError, match=r"^cannot read the cluster token at .*auth_token \(Permission denied\); copy"):
        tokens.read_token(token)


def test_a_head_token_that_cannot_be_made_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / ".ray").write_text("a file where the directory goes")
    with pytest.raises(UserError, match=r"^cannot create the cluster token at .*\.ray/auth_token: .*\.ray \(File"):
        tokens.ensure_token(tmp_path / ".ray" / "auth_token")
    corrupt = private(tmp_path / "corrupt", "two\nlines")
    with pytest.raises(UserError, match=r"holds 2 lines, .*; move it away and run again to have a new one made"):
        tokens.ensure_token(corrupt)

    def disk_full(fd, *args, **kwargs):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tokens.os, "fdopen", disk_full)
    token = tmp_path / "new" / "auth_token"
    with pytest.raises(UserError, match=r"^cannot write the cluster token at .* \(No space left on device\)"):
        tokens.ensure_token(token)
    assert not token.exists()  # half a token would be read back as a wrong one


def test_the_environment_turns_token_auth_on_and_macos_clustering(tmp_path):
    env = tokens.ray_environment(tmp_path / "t", platform="darwin")
    assert env == {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(tmp_path / "t"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    }
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in tokens.ray_environment(tmp_path / "t", platform="linux")


def test_a_driver_on_a_node_turns_token_auth_on_when_it_holds_the_token(tmp_path, monkeypatch, environ):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tokens.use_cluster_token() is False and "RAY_AUTH_MODE" not in environ  # no token here: none used
    token = private(tmp_path / "auth_token", TOKEN, 0o644)
    with pytest.raises(UserError, match=r"is open to other users \(mode 0644\)"):
        tokens.use_cluster_token(token)
    assert "RAY_AUTH_MODE" not in environ
    token.chmod(0o600)
    assert tokens.use_cluster_token(token) is True
    assert environ["RAY_AUTH_MODE"] == "token" and environ["RAY_AUTH_TOKEN_PATH"] == str(token)
    environ["RAY_AUTH_MODE"] = "disabled"  # said otherwise: left alone, and the file is not read
    token.chmod(0o644)
    assert tokens.use_cluster_token(token) is False and environ["RAY_AUTH_MODE"] == "disabled"


def test_a_token_file_named_to_a_driver_must_be_there_and_wins_over_the_environment(tmp_path, environ):
    with pytest.raises(UserError, match=r"^no cluster token at .*missing"):
        tokens.use_cluster_token(tmp_path / "missing")
    token = private(tmp_path / "given")
    environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "other")})
    assert tokens.use_cluster_token(token) is True and environ["RAY_AUTH_TOKEN_PATH"] == str(token)


def test_a_drivers_default_token_is_checked(tmp_path, monkeypatch, environ):
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".ray" / "auth_token"
    default.parent.mkdir()
    default.mkdir()
    with pytest.raises(UserError, match=r"auth_token is a directory"):
        tokens.use_cluster_token()
    default.rmdir()
    private(default, TOKEN, 0o664)
    with pytest.raises(UserError) as refused:
        tokens.use_cluster_token()
    assert str(refused.value) == open_to_others(default, 0o664) and "RAY_AUTH_MODE" not in environ
    default.chmod(0o600)
    assert tokens.use_cluster_token() is True and environ["RAY_AUTH_TOKEN_PATH"] == str(default)


def test_a_local_ray_finds_its_token_made_private_first(tmp_path, monkeypatch, environ):
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".ray" / "auth_token"
    assert tokens.ensure_local_token() == default
    assert mode(default) == 0o600 and len(default.read_text()) == 64
    made = default.read_text()
    assert tokens.ensure_local_token() == default and default.read_text() == made  # kept for the next run
    default.chmod(0o644)  # as Ray 2.60 wrote it, before raytrm made it first
    with pytest.raises(UserError) as refused:
        tokens.ensure_local_token()
    assert str(refused.value) == open_to_others(default, 0o644) and default.read_text() == made
    elsewhere = tmp_path / "elsewhere" / "token"
    environ["RAY_AUTH_TOKEN_PATH"] = str(elsewhere)  # where Ray's loader looks first
    assert tokens.ensure_local_token() == elsewhere and mode(elsewhere) == 0o600


@pytest.mark.parametrize("setting", [{"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN": TOKEN}])
def test_a_local_ray_without_a_token_file_gets_none(tmp_path, monkeypatch, environ, setting):
    monkeypatch.setenv("HOME", str(tmp_path))
    environ.update(setting)
    assert tokens.ensure_local_token() is None and not (tmp_path / ".ray").exists()


# A local run's driver with HOME in a temporary directory: raytrm's connect() starts the local Ray.
LOCAL_RUN = textwrap.dedent(
    """
    import os, stat, sys
    from pathlib import Path

    import ray
    from raytrm.distributed import cluster

    assert cluster.connect(None) is True
    token = Path.home() / ".ray" / "auth_token"
    try:
        print(oct(stat.S_IMODE(token.stat().st_mode)), os.environ.get("RAY_AUTH_MODE"), len(token.read_text()))
    finally:
        ray.shutdown()
    """
)


@pytest.mark.slow
def test_a_local_run_leaves_its_token_private(tmp_path):
    """Ray 2.60 turns token auth on for a local cluster and writes ~/.ray/auth_token 0644 if it finds none."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", LOCAL_RUN], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0o600", "token", "64"], done.stdout
