"""Addresses of this host's network interfaces (Linux), for what a process advertises to
peers on other hosts."""

from __future__ import annotations

import fcntl
import socket
import struct

from cpd.protocol.errors import ConfigError

_SIOCGIFADDR = 0x8915


def interface_ipv4(name: str) -> str:
    """The IPv4 address of interface ``name`` (e.g. ``eth0``); :class:`ConfigError` when
    there is no such interface or it has no IPv4 address."""
    if not name or len(name.encode()) > 15:
        raise ConfigError(f"network interface name {name!r} is not valid")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError as e:
            raise ConfigError(f"network interface {name!r} has no IPv4 address here "
                              f"({e.strerror})") from e
    return socket.inet_ntoa(raw[20:24])
