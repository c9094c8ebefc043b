"""Nodes advertise on DNS-SD (``_mlxpp._tcp.local.``) and ``mlxppctl discover`` lists those
whose advertisement is signed with the cluster secret; a forged one is ignored, counted and
logged escaped. Real multicast DNS (python-zeroconf) between network namespaces on one bridge,
nothing else on the machine's network."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxppd.wire.secret import write_new_secret
from tests.support.agents import VENV_BIN, Hosts, netns_unavailable

_WHY = netns_unavailable()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=f"needs network namespaces: {_WHY}"),
    pytest.mark.timeout(300),
]

#: a node advertising itself as an agent does (runtime/system/dnssd.py), until stdin closes
ADVERTISE = """
import asyncio, sys, time
from mlxppd.runtime.system.dnssd import DnssdAdvertiser
from mlxppd.wire.dnssd_advert import Advert, advert_key
from mlxppd.wire.secret import load_cluster_secret
secret = load_cluster_secret(flag_path=sys.argv[1], environ={})
node, address = sys.argv[2], sys.argv[3]
def advert():
    return Advert(node, "lab", 39601, 8 << 30, "cpu", "0.9.0", int(time.time()))
async def main():
    interfaces = None if address == "all" else [address]  # all: IPv4 and IPv6, link-local too
    advertiser = DnssdAdvertiser(advert, advert_key(secret.key_bytes()), interfaces=interfaces)
    await advertiser.start()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await advertiser.close()
asyncio.run(main())
"""

#: a forger without the secret: a made-up MAC, a name with a right-to-left override in it (a
#: log line showing it raw would read backwards from there)
FORGE = """
import socket, sys, time
from zeroconf import ServiceInfo, Zeroconf
address = sys.argv[1]
name = "stage-9\\u202eevil.lab._mlxpp._tcp.local."
props = {"v": "1", "id": "stage-9", "cl": "lab", "mem": "1", "acc": "cpu", "ver": "0.9.0",
         "ts": str(int(time.time())), "sig": "00" * 32}
info = ServiceInfo("_mlxpp._tcp.local.", name, port=39609, properties=props,
                   server="forger.local.", parsed_addresses=[address])
zc = Zeroconf(interfaces=[address])
zc.register_service(info)
print("ready", flush=True)
sys.stdin.read()
zc.close()
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    made = Hosts.create(3)
    yield made
    made.destroy()


def start(hosts: Hosts, index: int, code: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[index], sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise AssertionError(process.stderr.read()[-3000:])
    return process


def test_discover_lists_signed_nodes_and_ignores_a_forged_one(hosts: Hosts, tmp_path: Path) -> None:
    secret = tmp_path / "cluster.secret"
    write_new_secret(secret)
    real = start(hosts, 0, ADVERTISE, str(secret), "stage-1", hosts.addresses[0])
    forged = start(hosts, 1, FORGE, hosts.addresses[1])
    try:
        argv = [str(VENV_BIN / "mlxppctl"), "discover", "--cluster-secret-file", str(secret),
                "--cluster-name", "lab", "--timeout", "3", "--json"]  # fmt: skip
        for _ in range(5):  # multicast DNS answers within a second or two; allow a retry
            done = hosts.run(2, *argv, timeout=60)
            seen = json.loads(done.stdout) if done.stdout else {"nodes": [], "ignored": {}}
            if seen["nodes"] and seen["ignored"]:
                break
            time.sleep(1)
        assert done.returncode == 0, done.stderr
        (node,) = seen["nodes"]
        assert node["node_id"] == "stage-1" and node["port"] == 39601
        assert hosts.addresses[0] in node["addresses"]
        assert node["free_memory_bytes"] == 8 << 30 and node["accelerator"] == "cpu"
        assert seen["ignored"] == {"bad_mac": 1}
        # The forged name is logged escaped: its override never reaches the terminal raw.
        assert "stage-9\\u202eevil" in done.stderr and "\u202e" not in done.stderr
        assert "1 bad_mac" in done.stderr

        wrong = tmp_path / "other.secret"
        write_new_secret(wrong)
        argv[3] = str(wrong)
        done = hosts.run(2, *argv, timeout=60)
        assert done.returncode == 1 and json.loads(done.stdout)["nodes"] == []
        assert "no node of cluster 'lab' answered" in done.stderr
    finally:
        for process in (real, forged):
            process.communicate("", timeout=30)


def test_a_node_on_ipv6_link_local_is_found_with_its_scope(hosts: Hosts, tmp_path: Path) -> None:
    secret = tmp_path / "cluster.secret"
    write_new_secret(secret)
    node = start(hosts, 1, ADVERTISE, str(secret), "stage-6", "all")
    try:
        argv = [str(VENV_BIN / "mlxppctl"), "discover", "--cluster-secret-file", str(secret),
                "--cluster-name", "lab", "--timeout", "3", "--json"]  # fmt: skip
        for _ in range(5):
            done = hosts.run(2, *argv, timeout=60)
            seen = json.loads(done.stdout) if done.stdout else {"nodes": []}
            if seen["nodes"]:
                break
        assert done.returncode == 0, done.stderr
        (found,) = seen["nodes"]
        assert found["node_id"] == "stage-6"
        assert hosts.addresses[1] in found["addresses"]
        # The IPv6 link-local address, with the interface it was heard on (a scope to dial).
        assert any(a.startswith("fe80:") and "%" in a for a in found["addresses"]), found
    finally:
        node.communicate("", timeout=30)
