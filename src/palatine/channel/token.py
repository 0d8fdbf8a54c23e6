"""The cluster token: the shared secret of the channel handshake.

Resolution, first match wins: ``PALATINE_CLUSTER_TOKEN``; the file named by
``PALATINE_CLUSTER_TOKEN_FILE`` (surrounding whitespace stripped); the per-user file
``$XDG_CONFIG_HOME/palatine/cluster-token`` (default ``~/.config/palatine/``), created on
first use with 32 random bytes in hex and mode 0600 by a process that serves (a role, a
script's own cluster). A client command (``palatine top``, ``stacks``, ``snapshot``,
``stop``) never creates it (`resolve_token` with ``create=False``): a token made up there could
never match the job's, so it says where the job's token is instead (`ConfigError`). A token file that group or others
may read or write is refused, an empty token is refused, and a token under 16 bytes is
accepted with one WARNING.

The token is text (it travels to child processes in ``PALATINE_CLUSTER_TOKEN``), used
as bytes by the HMAC. It is resolved once per process and cached; launchers hand it on
with `token_env`, and private clusters (``local_mesh``, ``this_host``) install a fresh
one (`private_token`), one per process: the token is process-wide, so a process that has
both kinds reaches each only if they share it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Final

from palatine.errors import ConfigError

__all__ = [
    "MIN_TOKEN_BYTES",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "default_token_path",
    "generate_token",
    "private_token",
    "reset_token_cache",
    "resolve_token",
    "set_token",
    "token_env",
]

logger = logging.getLogger(__name__)

TOKEN_ENV: Final = "PALATINE_CLUSTER_TOKEN"
"""Variable holding the token itself (highest precedence; how launchers propagate it)."""

TOKEN_FILE_ENV: Final = "PALATINE_CLUSTER_TOKEN_FILE"
"""Variable naming a file that holds the token."""

MIN_TOKEN_BYTES: Final = 16
"""Shorter tokens work but draw a WARNING: they are guessable offline from one handshake."""

_lock = threading.Lock()
_cached: bytes | None = None
_private: str | None = None  # this process's private clusters' token (`private_token`)


def generate_token() -> str:
    """A fresh random token: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def token_env(token: bytes | str) -> dict[str, str]:
    """The environment a launcher adds for its children so they share ``token``."""
    text = os.fsdecode(token) if isinstance(token, bytes) else token
    return {TOKEN_ENV: text}


def default_token_path() -> Path:
    """The per-user token file: ``$XDG_CONFIG_HOME/palatine/cluster-token``.

    ``XDG_CONFIG_HOME`` counts only when it is an absolute path (as the XDG spec says);
    otherwise ``~/.config`` is used.
    """
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "palatine" / "cluster-token"


def _checked(token: bytes, source: str) -> bytes:
    if not token:
        raise ConfigError(f"empty cluster token from {source}")
    if len(token) < MIN_TOKEN_BYTES:
        logger.warning(
            "cluster token from %s is only %d bytes; use at least %d random bytes",
            source,
            len(token),
            MIN_TOKEN_BYTES,
        )
    return token


def _read_token_file(path: Path, source: str) -> bytes:
    """Read a token file after checking that only its owner can read or write it."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{source}: {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o066:
            raise ConfigError(
                f"{source}: cluster token file {path} has mode {mode:04o}; it must not be "
                f"readable or writable by group or others (chmod 600 {path})"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read cluster token file {path}: {exc}") from None
    return data.strip()


def _create_default_file(path: Path) -> None:
    """Create the per-user token file atomically (0600) unless another process won."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {path.parent} for the cluster token: {exc}") from None
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
            os.write(fd, (generate_token() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        # link() fails if the file exists: two first-time processes agree on one token,
        # and nobody ever reads a half-written file.
        try:
            os.link(tmp, path)
            logger.info("created cluster token file %s", path)
        except FileExistsError:
            pass
    except OSError as exc:
        raise ConfigError(f"cannot create cluster token file {path}: {exc}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _no_token_text(path: Path) -> str:
    """Where a client finds the job's token, when none is set and the per-user file is
    missing."""
    return (
        f"no cluster token: {TOKEN_ENV} and {TOKEN_FILE_ENV} are unset and {path} does not "
        f"exist, and a client never creates one. Use the job's token: a job of 'palatine "
        f"launch' or SlurmJob keeps it in the file 'token' in its log dir "
        f"(export {TOKEN_FILE_ENV}=<log dir>/token; 'palatine job status JOB' finds the "
        f"job), and a program 'palatine launch' runs has it in {TOKEN_ENV}"
    )


def _resolve(create: bool) -> bytes:
    env_token = os.environ.get(TOKEN_ENV)
    if env_token is not None:
        return _checked(os.fsencode(env_token), TOKEN_ENV)
    file_name = os.environ.get(TOKEN_FILE_ENV)
    if file_name:
        return _checked(_read_token_file(Path(file_name), TOKEN_FILE_ENV), str(file_name))
    path = default_token_path()
    if not path.exists():
        if not create:
            raise ConfigError(_no_token_text(path))
        _create_default_file(path)
    return _checked(_read_token_file(path, "cluster token"), str(path))


def resolve_token(*, create: bool = True) -> bytes:
    """The cluster token of this process (resolved on first use, then cached).

    ``create=False`` (a client command, before it dials): a missing per-user file is a
    `ConfigError` saying where the job's token is, never a new file.

    Raises `ConfigError` for an empty token, an unreadable file, or a token file that
    group or others can read or write (the message names the file and its mode).
    """
    global _cached
    with _lock:
        if _cached is None:
            _cached = _resolve(create)
        return _cached


def set_token(token: bytes | str) -> None:
    """Use ``token`` as this process's cluster token (private clusters, tests)."""
    global _cached
    raw = os.fsencode(token) if isinstance(token, str) else bytes(token)
    checked = _checked(raw, "set_token()")
    with _lock:
        _cached = checked


def private_token() -> str:
    """The token of this process's private clusters, installed (`set_token`): made by
    the first (`generate_token`), the same for every later one. A script that uses
    ``this_host()`` and a ``local_mesh`` reaches both: with a fresh token each, the
    second would lock the first's procs out of their own system."""
    global _private
    with _lock:
        if _private is None:
            _private = generate_token()
        token = _private
    set_token(token)
    return token


def reset_token_cache() -> None:
    """Forget the cached token so the next `resolve_token` reads the environment again."""
    global _cached
    with _lock:
        _cached = None
