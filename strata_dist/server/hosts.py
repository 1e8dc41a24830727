"""The Host allow-list (`--allowed-hosts`): a web page the user opens can make the browser send
requests to a server on this machine under the page's own name (DNS rebinding: `evil.example`
resolving to 127.0.0.1), and with no API key those would be served. The browser still says
`Host: evil.example:PORT`, so a request is served only under a name the server was given.

Default: the address it listens on, localhost, 127.0.0.1 and [::1], each with the port; when it
listens on every interface, also this machine's own names and any IP address with the port (a Host
that is an address never comes from a rebound name: the browser then talks to that address itself).
An entry with a port matches that port only; an entry without one matches the name on any port;
`*` allows any Host."""
from __future__ import annotations

import ipaddress
import socket

ANY = "*"
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def _split(host: str) -> tuple[str, str | None]:
    """('name', 'port' or None) of a Host value or an entry, lowercased, IPv6 in brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return host, None
        name, rest = host[:end + 1], host[end + 1:]
        return name, rest[1:] if rest.startswith(":") else None
    if host.count(":") == 1:
        name, port = host.split(":")
        return name, port
    if host.count(":") > 1:          # a bare IPv6 address (an entry written without brackets)
        return f"[{host}]", None
    return host, None


def _entry(name: str, port: int | None) -> str:
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    return f"{name.lower()}:{port}" if port is not None else name.lower()


def parse_allowed_hosts(text: str) -> tuple[str, ...]:
    """`--allowed-hosts a,b:8000,*`; ValueError naming the flag for an empty list or entry."""
    entries = [e.strip() for e in text.split(",")]
    if not text.strip() or any(not e for e in entries):
        raise ValueError(f"--allowed-hosts {text!r}: a comma-separated list of host names "
                         f"(name or name:port, '*' for any), with no empty entry")
    for e in entries:
        name, port = _split(e)
        if e != ANY and (not name or any(c in name for c in "/@ ?#") or
                         (port is not None and not port.isdigit())):
            raise ValueError(f"--allowed-hosts: {e!r} is not a host name or host:port")
    return tuple(entries)


def default_allowed_hosts(bind_host: str, port: int) -> tuple[str, ...]:
    names = [bind_host, "localhost", "127.0.0.1", "::1"]
    if bind_host in WILDCARD_BINDS:
        names = names[1:]
        try:
            me = socket.gethostname()
            names += [me, socket.getfqdn()]
        except OSError:
            pass
    out: list[str] = []
    for n in names:
        e = _entry(n, port)
        if n and e not in out:
            out.append(e)
    return tuple(out)


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
        return True
    except ValueError:
        return False


class HostCheck:
    """`addresses_on`: a port on which any IP-address Host is allowed (the default list of a
    server that listens on every interface)."""

    def __init__(self, allowed: tuple[str, ...], addresses_on: int | None = None):
        self.addresses_on = addresses_on
        self.any = ANY in allowed
        self.exact: set[str] = set()     # name:port
        self.names: set[str] = set()     # a name on any port
        for e in allowed:
            if e != ANY:
                name, port = _split(e)
                (self.exact.add(f"{name}:{port}") if port is not None else self.names.add(name))
        self.shown = ", ".join(allowed) + (f", any IP address:{addresses_on}"
                                           if addresses_on is not None else "")

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:   # no Host at all: no browser sent it
            return True
        name, port = _split(host)
        # no port in Host: the scheme's own (this server speaks plain HTTP)
        port = port or "80"
        if self.addresses_on is not None and port == str(self.addresses_on) and _is_address(name):
            return True
        return name in self.names or f"{name}:{port}" in self.exact
