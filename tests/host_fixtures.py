"""The host test bed for tests (kvfabric.bench.hosts): skip with one line where it cannot be built, else a bed
that must leave none of its namespaces behind; a P2P server and a checking fetcher on two of its hosts."""
from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from kvfabric.bench import hosts_p2p
from kvfabric.bench.hosts import HostBed, HostBedError, check_available, read_line
from kvfabric.config import ClusterConfig


def need_bed() -> None:
    try:
        check_available()
    except HostBedError as exc:
        pytest.skip(str(exc))


def host_bed(num_hosts: int) -> Iterator[HostBed]:
    need_bed()
    with HostBed(num_hosts) as made:
        yield made
    assert made.owned() == []


def start_pair(bed: HostBed, settings: ClusterConfig, num_chunks: int) -> tuple[subprocess.Popen, subprocess.Popen]:
    """A P2P server with num_chunks stored in host 0 and a checking fetcher in host 1 with the deadlines a peer
    tier would use (bench.hosts_p2p `serve` and `fetch-checked`); both ready."""
    server = bed.python(0, hosts_p2p.MODULE, "serve", bed.address(0), "--chunks", str(num_chunks),
                        stdin=subprocess.PIPE)
    port = json.loads(read_line(server, 120))["port"]
    client = bed.python(1, hosts_p2p.MODULE, "fetch-checked", bed.address(0), str(port), "--chunks", str(num_chunks),
                        "--fetch-timeout", str(settings.fetch_timeout_s), "--connect-timeout",
                        str(settings.connect_timeout_s), stdin=subprocess.PIPE)
    assert json.loads(read_line(client, 120)) == {"ready": True}
    return server, client


def ask(client: subprocess.Popen) -> None:
    """One fetch of all the chunks, by the fetcher of start_pair."""
    assert client.stdin is not None
    client.stdin.write(b"go\n")
    client.stdin.flush()
