"""Hosts on one machine: Linux network namespaces joined by veth pairs to a bridge in a
namespace of their own, each host with its own address. Needs root. Everything it
creates is removed by :meth:`Fabric.teardown` (deleting a namespace deletes its links).

Namespaces share the filesystem, ``/dev/shm`` and the boot id: UCX would take shared
memory between them unless told to use TCP only, which the multi-host test does so that
KV bytes really cross the links.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
SUBNET = "10.231.7"
_LOSS = "cpdloss"  # the nftables table of Fabric.drop


def available() -> str:
    """Why namespaces cannot be made here, or ``""`` when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    return ""


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


class Fabric:
    """``hosts`` namespaces ``<tag>-h1`` ... on one bridge, host i at ``SUBNET.i``."""

    def __init__(self, hosts: int, tag: str | None = None) -> None:
        self.tag = tag or f"cpd{os.getpid() % 100_000}"
        self.hosts = hosts
        self.switch = f"{self.tag}-sw"
        self.created: list[str] = []

    def ns(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.ns(i)]

    def prefix_switch(self) -> list[str]:
        """The command prefix that runs a program in the switch's namespace."""
        return ["ip", "netns", "exec", self.switch]

    def _port(self, i: int) -> str:
        return f"{self.tag}v{i}"  # the switch's end of host i's link

    def setup(self) -> Fabric:
        for name in [self.switch, *(self.ns(i) for i in range(1, self.hosts + 1))]:
            _ip("netns", "add", name)
            self.created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(1, self.hosts + 1):
            port = self._port(i)
            _ip("link", "add", port, "netns", self.switch, "type", "veth", "peer", "name",
                "eth0", "netns", self.ns(i))
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", self.ns(i), "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", self.ns(i), "link", "set", "eth0", "up")
        return self

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(received, sent) bytes of host ``i``'s ``eth0``."""
        info = json.loads(_ip("-n", self.ns(i), "-s", "-j", "link", "show", "eth0"))[0]
        stats = info["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def drop(self, i: int, percent: int) -> None:
        """Make host ``i``'s link lossy: the switch drops ``percent`` % of the frames host
        ``i`` sends and of those sent to it, at random (nftables on the bridge: a loss in
        the network, not in either host's stack; ``tc netem`` is not in every kernel).
        0 makes the link whole again."""
        nft = [*self.prefix_switch(), "nft"]
        subprocess.run([*nft, "delete", "table", "bridge", _LOSS], capture_output=True)
        if percent:
            port, pick = self._port(i), f"numgen random mod 100 < {percent} counter drop"
            rules = (f"table bridge {_LOSS} {{\n chain links {{\n type filter hook forward"
                     f' priority 0;\n iifname "{port}" {pick}\n oifname "{port}" {pick}\n'
                     " }\n}\n")
            subprocess.run([*nft, "-f", "-"], input=rules, text=True, check=True,
                           capture_output=True)

    def dropped(self) -> int:
        """Frames the lossy link (:meth:`drop`) has dropped."""
        listed = subprocess.run([*self.prefix_switch(), "nft", "-j", "list", "table",
                                 "bridge", _LOSS], check=True, capture_output=True,
                                text=True).stdout
        return sum(e["counter"]["packets"] for item in json.loads(listed)["nftables"]
                   for e in item.get("rule", {}).get("expr", []) if "counter" in e)

    def teardown(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()


class NetnsLoop:
    """An event loop on a thread of its own inside a namespace: every socket it opens
    lives there (the test process itself stays where it is)."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.loop = asyncio.new_event_loop()
        entered: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._main, args=(entered,), daemon=True)
        self.thread.start()
        entered.result(timeout=10)

    def _main(self, entered: concurrent.futures.Future[None]) -> None:
        try:
            fd = os.open(f"/run/netns/{self.ns}", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:  # this thread only
                    raise OSError(ctypes.get_errno(), f"setns into {self.ns}")
            finally:
                os.close(fd)
        except OSError as e:
            entered.set_exception(e)
            return
        entered.set_result(None)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, fn: Callable[[], Awaitable[T]], timeout: float = 300) -> T:
        """Run ``fn()`` on the namespace's loop and wait for its result."""
        async def call() -> T:
            return await fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
