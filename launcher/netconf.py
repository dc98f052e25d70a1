"""Network settings a multi-node job needs, derived instead of asked for.

* ``GLOO_SOCKET_IFNAME``: gloo binds the address the hostname resolves to,
  often 127.0.1.1 or a management interface; with ``--local-addr`` given, the
  interface that carries that address is the one the job's nodes reach each
  other on.
* ``is_host`` for the c10d rendezvous: torch decides whether this node hosts
  the rendezvous store by resolving the endpoint's hostname; when the
  endpoint is an address of this node's interfaces it is the host, else not
  (in network namespaces the hostname resolves to loopback on every node).

Only fills what the user did not set.
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def ipv4_of(ifname: str) -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("256s", ifname.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
    except OSError:
        return None
    finally:
        s.close()


def local_ipv4() -> dict[str, str]:
    """Interface name -> IPv4 address, for this network namespace."""
    out = {}
    for _idx, name in socket.if_nameindex():
        a = ipv4_of(name)
        if a:
            out[name] = a
    return out


def interface_for(host: str) -> str | None:
    """The interface (not loopback) that carries ``host``'s address here."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    return next((name for name, a in local_ipv4().items() if a == ip and name != "lo"), None)


def is_local(host: str) -> bool | None:
    """Whether ``host`` names an address of this node (None: cannot resolve)."""
    try:
        socket.gethostbyname(host)
    except OSError:
        return None
    return interface_for(host) is not None


def derive(args, env: dict) -> list[str]:
    """Fill GLOO_SOCKET_IFNAME (in ``env``) and is_host (in ``args.rdzv_conf``)
    for a multi-node c10d job; returns what was derived, for the log."""
    said = []
    if args.local_addr and "GLOO_SOCKET_IFNAME" not in env:
        ifname = interface_for(args.local_addr)
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
            said.append(f"GLOO_SOCKET_IFNAME={ifname} (carries --local-addr {args.local_addr})")
    if args.rdzv_backend == "c10d" and args.rdzv_endpoint and "is_host" not in (args.rdzv_conf or ""):
        host = args.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")
        if host not in ("localhost", "127.0.0.1", ""):
            local = is_local(host)
            if local is not None:
                conf = f"is_host={1 if local else 0}"
                args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
                said.append(f"rdzv is_host={int(local)} (endpoint {host} is {'' if local else 'not '}this node)")
    return said
