"""Channel addresses: parse, display, and pick an address to serve on.

A `ChannelAddr` names where a channel is served: ``tcp:HOST:PORT``, ``tls:HOST:PORT``, ``unix:/path``, ``unix:@name``,
``unix:`` and ``local:N``. Addresses are immutable values: they hash, compare, pickle
and encode with msgspec, and ``parse(str(a)) == a`` for every address.

`any_addr` chooses what a proc serves on when nobody told it: a routable tcp/tls
host with port 0, a ``local:0``, or a unix *path* socket inside a private per-user
directory (mode 0700). The socket helpers at the bottom (`ChannelAddr.sockaddr`,
`ChannelAddr.from_bound`, `secure_socket_file`, `remove_socket_file`) are the small
amount of OS plumbing the net channel needs; they live here so that every socket-level
detail of an address (abstract names, IPv6 brackets, path limits) sits in one module.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import socket
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from palatine import config
from palatine.channel.sockets import socket_dir_candidates, socket_file_name
from palatine.errors import AddrParseError, ConfigError

__all__ = [
    "NET_TRANSPORTS",
    "TRANSPORTS",
    "UNIX_PATH_MAX",
    "ChannelAddr",
    "any_addr",
    "is_loopback_host",
    "listen_error",
    "parse",
    "pick_host",
    "random_abstract_name",
    "require_addr",
    "remove_socket_file",
    "secure_socket_file",
    "unix_socket_dir",
]

logger = logging.getLogger(__name__)

TRANSPORTS: Final = ("tcp", "tls", "unix", "local")
"""Every transport a `ChannelAddr` may carry."""

NET_TRANSPORTS: Final = ("tcp", "tls", "unix")
"""Transports that use real sockets (and therefore the token handshake)."""

UNIX_PATH_MAX: Final = 107
"""Longest unix socket path (or abstract name) in bytes: ``sun_path`` is 108 with a NUL."""

_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_DIGITS = re.compile(r"[0-9]+")


def _bad_syntax(rest: str) -> AddrParseError:
    return AddrParseError(f"invalid socket address syntax: {rest!r}")


def _canonical_host(host: str, rest: str) -> str:
    """Validate a tcp/tls host; IP literals come back in their canonical text form."""
    if ":" in host:
        try:
            return str(ipaddress.IPv6Address(host))
        except ValueError:
            raise _bad_syntax(rest) from None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    name = host.removesuffix(".")
    if not name or len(name) > 253:
        raise _bad_syntax(rest)
    labels = name.split(".")
    if not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise _bad_syntax(rest)
    # "1.2.3" or "256.0.0.1" would be read as (broken) IPv4 by the resolver, not as names.
    if _DIGITS.fullmatch(labels[-1]):
        raise _bad_syntax(rest)
    return host


def _parse_port(text: str, rest: str) -> int:
    if not _DIGITS.fullmatch(text) or len(text) > 5 or int(text) > 65535:
        raise _bad_syntax(rest)
    return int(text)


def _split_host_port(rest: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` / ``[IPv6]:PORT`` / raw ``IPv6:PORT`` (at the last colon)."""
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0 or rest[close + 1 : close + 2] != ":":
            raise _bad_syntax(rest)
        inner = rest[1:close]
        if ":" not in inner:  # brackets are for IPv6 literals only
            raise _bad_syntax(rest)
        return _canonical_host(inner, rest), _parse_port(rest[close + 2 :], rest)
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise _bad_syntax(rest)
    return _canonical_host(host, rest), _parse_port(port, rest)


def _check_unix_len(text: str) -> None:
    try:
        size = len(os.fsencode(text))
    except UnicodeError:
        raise _bad_syntax(text) from None
    if size > UNIX_PATH_MAX:
        raise AddrParseError("unix socket path too long")


class ChannelAddr(msgspec.Struct, frozen=True, omit_defaults=True):
    """An immutable channel address; build it with `parse` or the named constructors.

    Fields by transport: ``tcp``/``tls`` use ``host`` (IP literal in canonical form, or
    a DNS name) and ``port``; ``unix`` uses either ``path`` (a filesystem socket) or
    ``name`` (a Linux abstract socket; ``""`` means "pick a random name when serving");
    ``local`` uses ``port``. Port 0 (and the empty abstract name) mean "any": valid to
    serve, never to dial, and the served address reports what was bound.
    """

    transport: str
    host: str = ""
    port: int = 0
    path: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        # Cheap shape check only; the named constructors and `parse` do full validation.
        if self.transport not in TRANSPORTS:
            raise AddrParseError(f"no such channel type: {self.transport}")
        if self.transport == "unix":
            if (self.path is None) == (self.name is None):
                raise AddrParseError("a unix address has exactly one of path or name")
        elif self.path is not None or self.name is not None:
            raise AddrParseError(f"a {self.transport} address has no path or name")
        if self.port < 0 or (self.transport != "local" and self.port > 65535):
            raise AddrParseError(f"invalid port {self.port} for {self.transport}")

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> ChannelAddr:
        """Parse the text form; same as the module's `parse`."""
        return parse(text)

    @classmethod
    def tcp(cls, host: str, port: int = 0) -> ChannelAddr:
        """A tcp address; ``host`` is an IP literal (IPv6 with or without brackets) or name."""
        return cls._net("tcp", host, port)

    @classmethod
    def tls(cls, host: str, port: int = 0) -> ChannelAddr:
        """A tls address (tcp with mutual TLS)."""
        return cls._net("tls", host, port)

    @classmethod
    def _net(cls, transport: str, host: str, port: int) -> ChannelAddr:
        text = f"{host}:{port}"
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not 0 <= port <= 65535:
            raise _bad_syntax(text)
        return cls(transport, host=_canonical_host(host, text), port=port)

    @classmethod
    def unix(cls, path: str | os.PathLike[str]) -> ChannelAddr:
        """A unix socket at a filesystem path."""
        text = os.fspath(path)
        if not text or "\0" in text or text.startswith("@"):
            # A leading "@" would print as an abstract name and not round-trip.
            raise _bad_syntax(text)
        _check_unix_len(text)
        return cls("unix", path=text)

    @classmethod
    def abstract(cls, name: str = "") -> ChannelAddr:
        """A Linux abstract unix socket; ``""`` means a random name chosen when serving."""
        if "\0" in name:
            raise _bad_syntax("@" + name)
        _check_unix_len("@" + name)  # the leading NUL of sun_path takes one byte
        return cls("unix", name=name)

    @classmethod
    def local(cls, port: int = 0) -> ChannelAddr:
        """An in-process address; ``local:0`` means "any" (serve only)."""
        if port < 0:
            raise AddrParseError(f"invalid local port: {str(port)!r}")
        return cls("local", port=port)

    @classmethod
    def from_bound(
        cls, transport: str, sock: socket.socket, host: str | None = None
    ) -> ChannelAddr:
        """The address a bound socket actually serves, reporting the real port or name.

        ``transport`` is the scheme to advertise (``tcp`` and ``tls`` both bind AF_INET
        or AF_INET6 sockets). ``host`` replaces the bound host, for a socket bound to a
        wildcard (``0.0.0.0``) that should advertise a routable address instead.
        """
        bound: Any = sock.getsockname()
        if sock.family == socket.AF_UNIX:
            if transport != "unix":
                raise ValueError(f"an AF_UNIX socket cannot serve {transport}:")
            if isinstance(bound, bytes):
                if bound.startswith(b"\0"):
                    return cls.abstract(os.fsdecode(bound[1:]))
                bound = os.fsdecode(bound)
            if not bound:
                raise ValueError("the unix socket is not bound")
            if bound.startswith("\0"):
                return cls.abstract(bound[1:])
            return cls.unix(bound)
        if transport not in ("tcp", "tls"):
            raise ValueError(f"an IP socket cannot serve {transport}:")
        return cls._net(transport, host if host is not None else bound[0], bound[1])

    def with_port(self, port: int) -> ChannelAddr:
        """This tcp/tls/local address with another port."""
        if self.transport == "local":
            return ChannelAddr.local(port)
        if self.transport == "unix":
            raise ValueError("unix addresses have no port")
        return self._net(self.transport, self.host, port)

    def with_name(self, name: str) -> ChannelAddr:
        """This unix address as the abstract socket ``name`` (e.g. for ``unix:``)."""
        if self.transport != "unix":
            raise ValueError(f"{self.transport} addresses have no abstract name")
        return ChannelAddr.abstract(name)

    # -- properties ---------------------------------------------------------------------

    @property
    def is_abstract(self) -> bool:
        """Whether this is a Linux abstract unix socket (``unix:@name`` or ``unix:``)."""
        return self.name is not None

    @property
    def is_any(self) -> bool:
        """Whether this asks for "any" port or name: serve it, never dial it."""
        if self.transport == "unix":
            return self.name == ""
        return self.port == 0

    @property
    def is_net(self) -> bool:
        """Whether this uses a real socket (tcp, tls, unix)."""
        return self.transport in NET_TRANSPORTS

    @property
    def is_loopback(self) -> bool:
        """Whether peers on other machines cannot reach this address.

        True for loopback IPs, ``localhost`` names, unix sockets and local addresses.
        DNS names other than ``localhost`` are not resolved and count as non-loopback.
        """
        if self.transport in ("unix", "local"):
            return True
        host = self.host.rstrip(".").lower()
        if host == "localhost" or host.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def family(self) -> socket.AddressFamily:
        """The socket family: AF_INET/AF_INET6 for IP literals, AF_UNSPEC for DNS names
        (the resolver decides), AF_UNIX for unix. Local addresses have none."""
        if self.transport == "unix":
            return socket.AF_UNIX
        if self.transport == "local":
            raise ValueError("local addresses have no socket family")
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            return socket.AF_UNSPEC
        return socket.AF_INET6 if ip.version == 6 else socket.AF_INET

    def sockaddr(self) -> tuple[str, int] | str:
        """The argument ``socket.bind``/``connect`` (and asyncio) take for this address.

        ``(host, port)`` for tcp/tls, the path for a unix path socket, and ``"\\0" + name``
        for an abstract socket. ``unix:`` has no name yet: serve ``with_name(
        random_abstract_name())`` instead. Local addresses have no socket address.
        """
        if self.transport == "local":
            raise ValueError("local addresses have no socket address")
        if self.transport == "unix":
            if self.path is not None:
                return self.path
            if not self.name:
                raise ValueError("unix: has no name yet; use with_name(random_abstract_name())")
            return "\0" + self.name
        return (self.host, self.port)

    # -- display ------------------------------------------------------------------------

    def __str__(self) -> str:
        if self.transport == "unix":
            if self.path is not None:
                return f"unix:{self.path}"
            return f"unix:@{self.name}" if self.name else "unix:"
        if self.transport == "local":
            return f"local:{self.port}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.transport}:{host}:{self.port}"

    def __repr__(self) -> str:
        return f"<ChannelAddr {self}>"


def require_addr(addr: object, who: str) -> None:
    """Raise `TypeError` unless ``addr`` is a `ChannelAddr`: what is inside takes a parsed
    address, and text given there would otherwise fail deep inside with an AttributeError.
    For entry points (a serve, a dial, a thread's start), not for every message."""
    if not isinstance(addr, ChannelAddr):
        raise TypeError(
            f"{who} takes a ChannelAddr, not {type(addr).__name__} {addr!r}; "
            "parse text with ChannelAddr.parse"
        )


def parse(text: str) -> ChannelAddr:
    """Parse a channel address, raising `AddrParseError`.

    The kind is split off at the legacy ``!`` separator (``tcp!127.0.0.1:80``) or at
    the first ``:``, whichever comes first, so a unix path containing ``!`` still
    round-trips. Text is parsed where it enters (a command line, a request, a handoff, a
    message); what is inside takes a `ChannelAddr`.
    """
    if not isinstance(text, str):
        raise TypeError(f"expected an address string, got {type(text).__name__}")
    cuts = [i for i in (text.find("!"), text.find(":")) if i >= 0]
    if not cuts:
        raise AddrParseError(f"no channel type specified: {text!r}")
    cut = min(cuts)
    kind, rest = text[:cut], text[cut + 1 :]
    if kind in ("tcp", "tls"):
        host, port = _split_host_port(rest)
        return ChannelAddr(kind, host=host, port=port)
    if kind == "unix":
        if rest in ("", "@"):
            return ChannelAddr.abstract("")
        if rest.startswith("@"):
            return ChannelAddr.abstract(rest[1:])
        return ChannelAddr.unix(rest)
    if kind == "local":
        if not _DIGITS.fullmatch(rest):
            raise AddrParseError(f"invalid local port: {rest!r}")
        return ChannelAddr.local(int(rest))
    raise AddrParseError(f"no such channel type: {kind}")


# -- any_addr --------------------------------------------------------------------------


def random_abstract_name() -> str:
    """A fresh abstract unix socket name, unique across processes and calls."""
    return f"palatine-{os.getpid()}-{secrets.token_hex(8)}"


def _configured_host() -> str | None:
    host_ip = config.get().host_ip
    if not host_ip:
        return None
    bare = host_ip[1:-1] if host_ip.startswith("[") and host_ip.endswith("]") else host_ip
    try:
        return _canonical_host(bare, host_ip)
    except AddrParseError:
        raise ConfigError(
            f"PALATINE_HOST_IP: expected an IP address or host name, got {host_ip!r}"
        ) from None


def _route_ip(peer: ChannelAddr) -> str | None:
    """The local IP of the interface that routes to ``peer`` (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(peer.host, peer.port or 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                local = probe.getsockname()[0]
        except OSError:
            continue
        if isinstance(local, str) and local not in ("0.0.0.0", "::"):
            return local.split("%", 1)[0] if family == socket.AF_INET6 else local
    return None


def _hostname_ip() -> str | None:
    """The first address the local hostname resolves to."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for *_, sockaddr in infos:
        return str(sockaddr[0]).split("%", 1)[0]
    return None


def pick_host(peers: Sequence[ChannelAddr] = (), *, use_config: bool = True) -> tuple[str, str]:
    """(host, why) for a tcp/tls server that ``peers`` dial: the host to listen on, and
    where it came from, in words for a message (``PALATINE_HOST_IP``, ``the route to
    10.0.0.5``, ``the local hostname vm``).

    In this order: ``PALATINE_HOST_IP``; a loopback of the first peer's family when that
    peer is loopback; the local IP of the interface that routes to the first peer that has
    a route (a connected UDP socket: nothing is sent); the local hostname's first address;
    ``127.0.0.1``. ``use_config=False`` leaves ``PALATINE_HOST_IP`` out (a caller that
    found it does not apply here)."""
    configured = _configured_host() if use_config else None
    if configured is not None:
        return configured, "PALATINE_HOST_IP"
    for peer in peers:
        if peer.transport not in ("tcp", "tls"):
            continue
        if peer.is_loopback:
            loopback = "::1" if peer.family == socket.AF_INET6 else "127.0.0.1"
            return loopback, f"peer {peer} is loopback"
        routed = _route_ip(peer)
        if routed is not None:
            return routed, f"the route to {peer.host}"
    named = _hostname_ip()
    if named is not None:
        return named, f"the local hostname {socket.gethostname()}"
    return "127.0.0.1", "no route and no address for the local hostname"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP literal or a name) is one that only this machine reaches."""
    return ChannelAddr.tcp(host).is_loopback


def listen_error(host: str) -> str | None:
    """Why this machine cannot listen on ``host`` (an IP literal or a name), in the OS's
    words; None when it can. It binds a throwaway socket to a free port there."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        return f"cannot resolve {host}: {e}"
    why = f"no address for {host}"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(sockaddr)
            return None
        except OSError as e:
            why = e.strerror or str(e)
    return why


def any_addr(transport: str, peer: ChannelAddr | None = None) -> ChannelAddr:
    """An address to serve ``transport`` on, dialable by ``peer``.

    tcp/tls: port 0 on ``PALATINE_HOST_IP``, else a loopback of the peer's family when
    the peer is loopback, else the local IP routing to the peer, else the local
    hostname's first address, else ``127.0.0.1``. unix: a fresh path socket in the
    private per-user directory (`unix_socket_dir`). local: ``local:0``.
    """
    if peer is not None:
        require_addr(peer, "any_addr(peer=)")
    if transport in ("tcp", "tls"):
        host, why = pick_host([peer] if peer is not None else [])
        addr = ChannelAddr._net(transport, host, 0)
        logger.debug("any_addr(%s) -> %s (%s)", transport, addr, why)
        return addr
    if transport == "unix":
        return ChannelAddr.unix(_fresh_socket_path())
    if transport == "local":
        return ChannelAddr.local(0)
    raise AddrParseError(f"no such channel type: {transport}")


# -- the private unix socket directory -------------------------------------------------


def _ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` 0700, or check that an existing one is ours and private."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create unix socket directory {directory}: {exc}") from None
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"unix socket directory {directory} is not a directory (or is a symlink); "
            "remove it or set XDG_RUNTIME_DIR"
        )
    uid = os.getuid()
    if st.st_uid != uid:
        raise ConfigError(
            f"unix socket directory {directory} is owned by uid {st.st_uid}, not {uid}; "
            "remove it or set XDG_RUNTIME_DIR"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        # Ours, so fix it: mkdir honours the umask, and an old directory may be looser.
        if mode & 0o077:
            logger.warning("unix socket directory %s had mode %04o; setting 0700", directory, mode)
        os.chmod(directory, 0o700)


def unix_socket_dir() -> Path:
    """The private per-user directory for unix path sockets, created 0700 if missing.

    ``$XDG_RUNTIME_DIR/palatine`` when that runtime directory exists, else
    ``palatine-<uid>`` in the system temp directory. An existing directory must be
    owned by this user; a looser mode is tightened to 0700. Raises `ConfigError`.
    """
    directory = socket_dir_candidates()[0]
    _ensure_private_dir(directory)
    return directory


def _fresh_socket_path() -> str:
    name = socket_file_name()
    for directory in socket_dir_candidates():
        path = directory / name
        if len(os.fsencode(str(path))) <= UNIX_PATH_MAX:
            _ensure_private_dir(directory)
            return str(path)
        logger.debug("unix socket directory %s is too long for sun_path; trying next", directory)
    raise ConfigError(
        "unix socket path too long: every candidate directory "
        f"({', '.join(map(str, socket_dir_candidates()))}) exceeds {UNIX_PATH_MAX} bytes; "
        "set XDG_RUNTIME_DIR or TMPDIR to a shorter directory"
    )


def secure_socket_file(addr: ChannelAddr) -> None:
    """Give a freshly bound unix path socket mode 0600 (abstract and IP: nothing to do).

    Call it right after ``bind``: the 0700 directory already keeps other users out of
    the window between bind and chmod.
    """
    if addr.transport == "unix" and addr.path is not None:
        os.chmod(addr.path, 0o600)


def remove_socket_file(addr: ChannelAddr) -> None:
    """Remove a unix path socket file when its Rx stops; anything that is not a socket
    (or is already gone) is left alone."""
    if addr.transport != "unix" or addr.path is None:
        return
    try:
        if stat.S_ISSOCK(os.lstat(addr.path).st_mode):
            os.unlink(addr.path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove unix socket file %s: %s", addr.path, exc)
