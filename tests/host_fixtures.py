"""The host test bed for tests (kvfabric.bench.hosts): skip with one line where it cannot be built, else a bed
that must leave none of its namespaces behind."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.bench.hosts import HostBed, HostBedError, check_available


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
