"""Which of this host's addresses another host can reach, for the bootstrap of torch's groups.

Hosts often resolve their own name to a loopback address (Debian and Ubuntu put
``127.0.1.1 <hostname>`` in /etc/hosts): an address bound there, or advertised to the other
hosts, reaches nobody. These helpers find the address (and interface) this host uses to
reach a given peer instead, from the routing table: a UDP socket's ``connect`` picks the
source address without sending anything.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def own_address() -> str | None:
    """This host's address as its hostname resolves (``None`` when it does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def address_towards(peers: Iterable[str]) -> str | None:
    """The source address this host would use to reach the first reachable of ``peers``
    (names or addresses), skipping loopback; ``None`` when no peer resolves to a route."""
    for peer in peers:
        try:
            infos = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)
        except OSError:
            continue
        for family, _, _, _, sockaddr in infos:
            if is_loopback(str(sockaddr[0])):
                continue
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                try:
                    probe.connect(sockaddr)  # a route lookup: UDP connect sends nothing
                except OSError:
                    continue
                source: str = probe.getsockname()[0]
            if not is_loopback(source):
                return source
    return None


def interface_with_address(address: str) -> str | None:
    """The name of the (IPv4) interface that holds ``address``, or ``None``."""
    try:
        interfaces = socket.if_nameindex()
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in interfaces:
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this one
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None
