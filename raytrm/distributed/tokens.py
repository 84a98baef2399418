"""Cluster token files: one rule for every token file raytrm, or the Ray it starts, writes or reads.

Each is private to its owner (mode 0600): raytrm creates its own so, and refuses one that other users could read or
replace, with the `chmod 600` to run. It never changes a file's mode behind the user's back, and a refusal is one
line (a fix made for the user would print a second line beside any error that follows). A file that is missing,
empty, unreadable, a directory or not a token is one line too, and the token itself is never shown. Ray's token
authentication is on for every node and driver that holds one, and for a local Ray, whose token raytrm makes
before Ray would write one every user can read.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import sys
from pathlib import Path

from raytrm.errors import UserError

# Ray's own environment knobs that a raytrm node sets for `ray start` (declared by Ray, named here once).
RAY_AUTH_MODE_ENV, RAY_TOKEN_PATH_ENV, RAY_TOKEN_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"
RAY_MAC_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray keeps a token file's first line, stripped; raytrm accepts one word of visible ASCII, so a file of several lines
# or one that is not text is refused instead of read as some other token.
TOKEN_PATTERN = re.compile(r"[!-~]+")
TOKEN_MAX_CHARS, TOKEN_MAX_BYTES = 1024, 4096


def default_token_path() -> Path:
    """Where Ray (drivers, `ray job submit`) looks for the token without being told: ~/.ray/auth_token."""
    return Path.home() / ".ray" / "auth_token"


def ensure_token(path: Path) -> bool:
    """The head's token at path, created (a random 256-bit hex string, mode 0600) if missing; True if created.

    An existing token is kept (nodes that joined with it keep working) once read_token finds it private and sound.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create the cluster token at {path}: {path.parent} ({e.strerror or e}); make it a directory "
            "you can write, or pass --token-file"
        ) from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        read_token(path, fix=_REPLACE_TOKEN)
        return False
    except OSError as e:
        raise UserError(
            f"cannot create the cluster token at {path} ({e.strerror or e}); make {path.parent} a directory you can "
            "write, or pass --token-file"
        ) from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    except OSError as e:
        path.unlink(missing_ok=True)  # half a token would be read back as a wrong one
        raise UserError(f"cannot write the cluster token at {path} ({e.strerror or e}); free some space") from None
    return True


_REPLACE_TOKEN = "move it away and run again to have a new one made (nodes that joined with it must copy the new one)"


def _copy_token(path: Path, head: str | None) -> str:
    return f"copy the head's (`scp {head or 'HEAD'}:.ray/auth_token {path} && chmod 600 {path}`)"


def read_token(path: Path, head: str | None = None, fix: str | None = None) -> str:
    """The token in path, once the file is found private to its owner: one rule for every token file raytrm reads.

    A file other users could read or replace is refused with the chmod to run; a missing, empty or unreadable file,
    a directory, or one that is not a token is one line. The token itself is never shown. fix: what to do about a
    bad file (default: copy the head's token over).
    """
    fix = fix or _copy_token(path, head)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(
            f"no cluster token at {path}: copy the head's ~/.ray/auth_token here "
            f"(`scp {head or 'HEAD'}:.ray/auth_token {path} && chmod 600 {path}`), or pass --token-file"
        ) from None
    except OSError as e:
        raise UserError(f"cannot read the cluster token at {path} ({e.strerror or e}); {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        found = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise UserError(f"the cluster token at {path} is {found}, expected a file holding the token; {fix}")
    _check_private(path, stat.S_IMODE(st.st_mode))
    try:
        with open(path, "rb") as f:
            data = f.read(TOKEN_MAX_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read the cluster token at {path} ({e.strerror or e}); {fix}") from None
    problem = _token_problem(data)
    if problem:
        raise UserError(f"the cluster token at {path} {problem}, expected one line of letters and digits; {fix}")
    return data.decode("ascii").strip()


def _token_problem(data: bytes) -> str | None:
    """What is wrong with a token file's bytes, without showing them (they may be the secret), or None."""
    if len(data) > TOKEN_MAX_BYTES:
        return f"holds more than {TOKEN_MAX_BYTES} bytes"
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return "is not text (bytes other than ASCII)"
    if not text:
        return "is empty"
    if "\n" in text or "\r" in text:
        return f"holds {len(text.splitlines())} lines"
    if len(text) > TOKEN_MAX_CHARS:
        return f"holds a line of {len(text)} characters (at most {TOKEN_MAX_CHARS})"
    if not TOKEN_PATTERN.fullmatch(text):
        return "holds spaces or control characters"
    return None


def _check_private(path: Path, mode: int) -> None:
    """One line with the chmod to run where other users could read or replace the token (group or other bits)."""
    if mode & 0o077:
        raise UserError(
            f"the cluster token at {path} is open to other users (mode {mode:04o}): anyone on this Mac could read it "
            f"and drive the cluster; run `chmod 600 {path}` and try again"
        )


def ray_environment(token_path: Path, platform: str = sys.platform) -> dict[str, str]:
    """The environment `ray start` (and every driver) needs: token auth on, the token's file, macOS clustering."""
    env = {RAY_AUTH_MODE_ENV: "token", RAY_TOKEN_PATH_ENV: str(token_path)}
    if platform == "darwin":
        env[RAY_MAC_CLUSTER_ENV] = "1"  # else a Mac's node listens on 127.0.0.1 only and workers cannot join
    return env


def use_cluster_token(token_file: Path | None = None) -> bool:
    """Turn Ray's token authentication on for this process and its children when this Mac holds a cluster token
    (token_file, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and RAY_AUTH_MODE says nothing else; True if it did.

    The token file is checked (read_token); a token_file given but missing is one line, while no token at the
    default places means a cluster without tokens. Ray reads its auth mode when it is imported: call
    this before anything imports ray.
    """
    mode = os.environ.get(RAY_AUTH_MODE_ENV)
    if mode and mode.lower() != "token":
        return False
    if token_file is None:
        token_file = Path(os.environ.get(RAY_TOKEN_PATH_ENV) or default_token_path())
        if not os.path.lexists(token_file):
            return False
    read_token(token_file)
    os.environ.update(ray_environment(token_file))
    return True


def ensure_local_token() -> Path | None:
    """The token file of a local Ray about to start here, created 0600 (or checked, as read_token does) before Ray
    looks for it.

    Ray turns token authentication on for a local cluster unless RAY_AUTH_MODE says otherwise and, finding no token,
    writes ~/.ray/auth_token with the umask's mode (0644: every user could read it and drive the cluster). Made here
    first, Ray finds it and uses it. None where Ray will not read a token file (auth off, or the token in the
    environment).
    """
    mode = os.environ.get(RAY_AUTH_MODE_ENV)
    if (mode and mode.lower() != "token") or os.environ.get(RAY_TOKEN_ENV):
        return None
    path = Path(os.environ.get(RAY_TOKEN_PATH_ENV) or default_token_path()).expanduser()
    ensure_token(path)
    return path
