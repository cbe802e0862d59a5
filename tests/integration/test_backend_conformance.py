"""The conformance kit against every backend this branch ships: fake and local.

These are the exact subclasses a third-party author writes (see
docs/guides/conformance-kit.md); the local pair also checks data
integrity and the release gate with real torch pages.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase, settings

from kvfsm import TransferManager
from kvfsm.testing import BackendConformance, BackendPair

torch = pytest.importorskip("torch", reason="the local backend moves torch tensors")

from kvfsm.backends.base import KVPools  # noqa: E402
from kvfsm.backends.fake import FakeBackend  # noqa: E402
from kvfsm.backends.local import NO_FAULTS, Faults, LocalBackend, LocalFabric  # noqa: E402

PAGES = 12
# Half the profile's examples (the ci profile runs ten times more), short runs of steps.
HALF = settings(max_examples=max(10, settings().max_examples // 2), stateful_step_count=30)
LAYERS = 2
WORDS_PER_PAGE = 4


class FakeBackendConformance(BackendConformance):
    def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
        sending, receiving = FakeBackend(sender), FakeBackend(receiver)
        return BackendPair(sender=sending, receiver=receiving, peer=sending.address, num_pages=PAGES)


AUX_SLOTS = 4


def _pools() -> tuple[KVPools, list[Any], Any]:
    k = torch.zeros(LAYERS, PAGES, WORDS_PER_PAGE, dtype=torch.int64)
    v = torch.zeros(LAYERS, PAGES, WORDS_PER_PAGE, dtype=torch.int64)
    aux = torch.zeros(AUX_SLOTS, 2, dtype=torch.int64)
    return KVPools.from_tensors(k, v, aux), [k, v], aux


class LocalBackendConformance(BackendConformance):
    faults: Faults = NO_FAULTS

    def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
        fabric = LocalFabric()
        # One worker: settle() then only has to wait for one queue.
        sending = LocalBackend(sender, fabric=fabric, workers=1, faults=self.faults)
        receiving = LocalBackend(receiver, fabric=fabric)
        source_pools, source, source_aux = _pools()
        destination_pools, destination, destination_aux = _pools()
        sending.register_pools(source_pools)
        receiving.register_pools(destination_pools)

        def write_source(page: int, token: int) -> None:
            for tensor in source:
                tensor[:, page] = token

        def write_destination(page: int, token: int) -> None:
            for tensor in destination:
                tensor[:, page] = token

        def read_destination(page: int) -> int:
            values = torch.cat([tensor[:, page].reshape(-1) for tensor in destination]).unique()
            return int(values[0]) if values.numel() == 1 else -2  # -2: a torn page

        def write_source_aux(slot: int, token: int) -> None:
            source_aux[slot] = token

        def read_destination_aux(slot: int) -> int:
            values = destination_aux[slot].unique()
            return int(values[0]) if values.numel() == 1 else -2

        def settle() -> None:
            # Every chunk queued so far has run once a no-op queued after them has.
            sending._pool.submit(lambda: None).result()  # type: ignore[union-attr]

        return BackendPair(
            sender=sending,
            receiver=receiving,
            peer=sending.address,
            write_source=write_source,
            read_destination=read_destination,
            write_destination=write_destination,
            write_source_aux=write_source_aux,
            read_destination_aux=read_destination_aux,
            settle=settle,
        )


TestFakeBackend = FakeBackendConformance.TestCase
TestFakeBackend.settings = HALF
TestLocalBackend = LocalBackendConformance.TestCase
TestLocalBackend.settings = HALF


class FaultyLocalBackendConformance(LocalBackendConformance):
    """Chunks that fail half-written, commit markers naming the wrong room, writes after abort."""

    faults = Faults(fail_rate=0.15, corrupt_marker_rate=0.15, linger_chunks=1, seed=5)


TestFaultyLocalBackend = FaultyLocalBackendConformance.TestCase
TestFaultyLocalBackend.settings = HALF


class NeverDrains(FakeBackend):
    """Broken: forgets to report writes drained after a failure."""

    def _stop(self, handle: Any) -> None:
        return


class NoDataMoved(FakeBackend):
    """Broken when it claims to move data: succeeds without copying anything."""


def _run_expecting_failure(machine: type[BackendConformance], match: str) -> None:
    case = machine.TestCase
    # Only that the kit fails matters here, not the smallest failing run: shrinking it took
    # most of this test's time (63 s of CI's run) and proves nothing more.
    case.settings = settings(
        max_examples=200,
        stateful_step_count=30,
        report_multiple_bugs=False,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        derandomize=True,
    )
    with pytest.raises(AssertionError, match=match):
        case("runTest").runTest()


def test_the_kit_catches_an_adapter_that_never_drains() -> None:
    class Broken(BackendConformance):
        def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
            sending, receiving = NeverDrains(sender), NeverDrains(receiver)
            return BackendPair(sender=sending, receiver=receiving, peer=sending.address, num_pages=PAGES)

    _run_expecting_failure(Broken, "never reported writes_drained")


def test_the_kit_catches_an_adapter_that_loses_data() -> None:
    class Broken(BackendConformance):
        def make_backends(self, sender: TransferManager, receiver: TransferManager) -> BackendPair:
            sending, receiving = NoDataMoved(sender), NoDataMoved(receiver)
            pages: dict[int, int] = {}
            return BackendPair(
                sender=sending,
                receiver=receiving,
                peer=sending.address,
                num_pages=PAGES,
                write_source=lambda page, token: None,
                read_destination=lambda page: pages.get(page, 0),
            )

    _run_expecting_failure(Broken, "succeeded before every chunk was sent|destination page")
