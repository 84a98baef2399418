"""Cluster token files: made 0600, tightened with a warning or refused with the chmod to run, every bad file one line
that never shows the token; a local Ray finds its token private (no Ray started, except the one slow test)."""

from __future__ import annotations

import errno
import logging
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


@pytest.mark.parametrize("readable", [0o644, 0o640, 0o604, 0o666, 0o700, 0o444])
def test_a_token_others_can_read_is_made_private_with_a_warning(tmp_path, caplog, readable):
    token = tmp_path / "auth_token"
    token.write_text(TOKEN + "\n")
    token.chmod(readable)
    with caplog.at_level(logging.WARNING, logger="raytrm.distributed.tokens"):
        assert tokens.read_token(token) == TOKEN
    assert token.read_text() == TOKEN + "\n"
    assert mode(token) == (0o600 if readable & 0o077 else readable)
    if readable & 0o077:
        assert caplog.messages == [
            f"the cluster token at {token} was open to other users (mode {readable:04o}): now 0600"
        ]
    else:  # only its owner could read it: left as it was, and nothing said
        assert caplog.messages == []


def test_a_token_this_user_cannot_make_private_is_refused_with_the_chmod_to_run(tmp_path, monkeypatch):
    token = tmp_path / "auth_token"
    token.write_text(TOKEN)
    token.chmod(0o644)

    def not_owner(self, mode):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(type(token), "chmod", not_owner)
    with pytest.raises(UserError) as refused:
        tokens.read_token(token)
    assert str(refused.value) == (
        f"the cluster token at {token} is open to other users (mode 0644) and cannot be made private here (Operation "
        f"not permitted); run `chmod 600 {token}` as its owner"
    )


def test_the_head_tightens_its_own_token_as_every_reader_does(tmp_path):
    token = tmp_path / "auth_token"
    token.write_text(TOKEN)
    token.chmod(0o644)  # as Ray writes its own
    assert tokens.ensure_token(token) is False
    assert mode(token) == 0o600 and token.read_text() == TOKEN


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
    token = tmp_path / "auth_token"
    token.write_bytes(content)
    with pytest.raises(UserError) as refused:
        tokens.read_token(token, head="10.0.0.1")
    assert str(refused.value) == (
        f"the cluster token at {token} {problem}, expected one line of letters and digits; copy the head's (`scp "
        f"10.0.0.1:.ray/auth_token {token} && chmod 600 {token}`)"
    )
    assert token.read_bytes() == content and mode(token) == 0o600  # made private, never rewritten
    assert "ab12" not in str(refused.value) and "cd34" not in str(refused.value)


def test_a_token_of_a_single_line_with_spaces_around_is_read_as_ray_reads_it(tmp_path):
    token = tmp_path / "auth_token"
    token.write_text(f"  {TOKEN}  \n\n")
    assert tokens.read_token(token) == TOKEN


def test_a_token_that_is_a_directory_a_fifo_or_unreadable_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    with pytest.raises(UserError, match=r"^the cluster token at .*dir is a directory, expected a file holding the"):
        tokens.read_token(tmp_path / "dir")
    os.mkfifo(tmp_path / "fifo")  # reading it would wait for a writer forever
    with pytest.raises(UserError, match=r"^the cluster token at .*fifo is not a regular file, expected a file"):
        tokens.read_token(tmp_path / "fifo")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"^cannot read the cluster token at .*file/token \(Not a directory\); copy"):
        tokens.read_token(tmp_path / "file" / "token")

    def unreadable(*args, **kwargs):  # as root, mode 000 is still readable: the refusal is faked
        raise PermissionError(errno.EACCES, "Permission denied")

    token = tmp_path / "auth_token"
    token.write_text(TOKEN)
    monkeypatch.setattr(tokens, "open", unreadable, raising=False)
    with pytest.raises(UserError, match=r"^cannot read the cluster token at .*auth_token \(Permission denied\); copy"):
        tokens.read_token(token)


def test_a_head_token_that_cannot_be_made_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / ".ray").write_text("a file where the directory goes")
    with pytest.raises(UserError, match=r"^cannot create the cluster token at .*\.ray/auth_token: .*\.ray \(File"):
        tokens.ensure_token(tmp_path / ".ray" / "auth_token")
    corrupt = tmp_path / "corrupt"
    corrupt.write_text("two\nlines")
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
    token = tmp_path / "auth_token"
    token.write_text(TOKEN)
    token.chmod(0o644)
    assert tokens.use_cluster_token(token) is True and mode(token) == 0o600
    assert environ["RAY_AUTH_MODE"] == "token" and environ["RAY_AUTH_TOKEN_PATH"] == str(token)
    environ["RAY_AUTH_MODE"] = "disabled"  # said otherwise: left alone, and the file is not read
    token.chmod(0o644)
    assert tokens.use_cluster_token(token) is False and environ["RAY_AUTH_MODE"] == "disabled"
    assert mode(token) == 0o644


def test_a_token_file_named_to_a_driver_must_be_there_and_wins_over_the_environment(tmp_path, environ):
    with pytest.raises(UserError, match=r"^no cluster token at .*missing"):
        tokens.use_cluster_token(tmp_path / "missing")
    token = tmp_path / "given"
    token.write_text(TOKEN)
    environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "other")})
    assert tokens.use_cluster_token(token) is True and environ["RAY_AUTH_TOKEN_PATH"] == str(token)


def test_a_drivers_default_token_is_checked_and_made_private(tmp_path, monkeypatch, environ):
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".ray" / "auth_token"
    default.parent.mkdir()
    default.mkdir()
    with pytest.raises(UserError, match=r"auth_token is a directory"):
        tokens.use_cluster_token()
    default.rmdir()
    default.write_text(TOKEN)
    default.chmod(0o664)
    assert tokens.use_cluster_token() is True and mode(default) == 0o600
    assert environ["RAY_AUTH_TOKEN_PATH"] == str(default)


def test_a_local_ray_finds_its_token_made_private_first(tmp_path, monkeypatch, environ):
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".ray" / "auth_token"
    assert tokens.ensure_local_token() == default
    assert mode(default) == 0o600 and len(default.read_text()) == 64
    made = default.read_text()
    default.chmod(0o644)  # as Ray 2.60 writes it
    assert tokens.ensure_local_token() == default and mode(default) == 0o600 and default.read_text() == made
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
