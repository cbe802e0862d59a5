"""The adapter protocol's shared pieces: pool descriptions, index checks, the registry."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvfsm
from kvfsm.backends import (
    BACKENDS,
    BackendError,
    KVBackend,
    KVPools,
    MemoryRegion,
    TransferInputError,
    get_backend,
    register_backend,
)
from kvfsm.backends.base import check_pages


def test_memory_region_of_tensor_describes_pages() -> None:
    tensor = torch.zeros((8, 4, 16), dtype=torch.bfloat16)
    region = MemoryRegion.of_tensor(tensor, "k0")
    assert region.ptr == tensor.data_ptr()
    assert region.nbytes == 8 * 4 * 16 * 2
    assert region.page_nbytes == 4 * 16 * 2
    assert region.num_pages == 8
    assert region.dtype == "bfloat16"
    assert region.device == "cpu"


def test_memory_region_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="not a multiple of page_nbytes"):
        MemoryRegion(ptr=0, nbytes=100, page_nbytes=30)
    with pytest.raises(ValueError, match="page_nbytes must be > 0"):
        MemoryRegion(ptr=0, nbytes=0, page_nbytes=0)
    with pytest.raises(TypeError, match="ptr must be an int >= 0"):
        MemoryRegion(ptr=-1, nbytes=10, page_nbytes=10)
    with pytest.raises(ValueError, match="must be contiguous"):
        MemoryRegion.of_tensor(torch.zeros(4, 4).t())


def test_kv_pools_from_stacked_and_listed_tensors_agree() -> None:
    k = torch.zeros((3, 10, 8), dtype=torch.float16)
    v = torch.zeros((3, 10, 8), dtype=torch.float16)
    stacked = KVPools.from_tensors(k, v, torch.zeros(4, 2))
    listed = KVPools.from_tensors(list(k.unbind(0)), list(v.unbind(0)), [torch.zeros(4, 2)])
    assert [r.name for r in stacked.kv] == ["k0", "v0", "k1", "v1", "k2", "v2"]
    assert stacked.layout == listed.layout
    assert stacked.num_pages == 10
    assert stacked.num_aux_slots == 4
    assert stacked.page_nbytes == 6 * 16
    assert stacked.layout_mismatch(listed) is None


def test_kv_pools_validation_and_mismatch_messages() -> None:
    with pytest.raises(ValueError, match="same number of pages"):
        KVPools([MemoryRegion(0, 100, 10, name="a"), MemoryRegion(0, 200, 10, name="b")])
    with pytest.raises(ValueError, match="at least one KV region"):
        KVPools([])
    with pytest.raises(TypeError, match="MemoryRegion items"):
        KVPools([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="K has 2 layers but V has 1"):
        KVPools.from_tensors([torch.zeros(2, 2)] * 2, [torch.zeros(2, 2)])
    a = KVPools([MemoryRegion(0, 100, 10, dtype="bfloat16")])
    assert "dtype bfloat16 here, float16 on the peer" in (
        a.layout_mismatch(KVPools([MemoryRegion(0, 100, 10, dtype="float16")])) or ""
    )
    assert "10 bytes per page here, 20" in (a.layout_mismatch(KVPools([MemoryRegion(0, 100, 20)])) or "")
    assert "1 KV regions here, 2" in (
        a.layout_mismatch(KVPools([MemoryRegion(0, 100, 10), MemoryRegion(0, 100, 10)])) or ""
    )


def test_check_pages_names_room_position_and_range() -> None:
    assert check_pages(3, [0, 4], 5, "pages") == [0, 4]
    with pytest.raises(TransferInputError, match=r"room 3: pages\[1\] = 5 is out of range: the pool has 5"):
        check_pages(3, [0, 5], 5, "pages")
    with pytest.raises(TransferInputError, match=r"pages\[0\] must be an integer page index; got NoneType"):
        check_pages("r", [None], 5, "pages")  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [1.9, 2.0, "2", True, None, b"1"])
def test_page_indices_must_be_integers_not_converted(bad: object) -> None:
    """`[1.9, 2.2]` used to become pages 1 and 2 and end Success (issue 11, defect 11)."""
    with pytest.raises(TransferInputError, match=r"pages\[1\] must be an integer page index"):
        check_pages(7, [0, bad], 5, "pages")  # type: ignore[list-item]


def test_numpy_integers_are_page_indices() -> None:
    numpy = pytest.importorskip("numpy", reason="numpy integer scalars need numpy")
    assert check_pages(7, [numpy.int64(3), numpy.uint8(4), numpy.int32(0)], 5, "pages") == [3, 4, 0]
    with pytest.raises(TransferInputError, match="must be an integer page index; got float64"):
        check_pages(7, [numpy.float64(3)], 5, "pages")


def test_destination_pages_must_be_unique() -> None:
    assert check_pages(7, [3, 3], 5, "pages") == [3, 3]  # sources may repeat
    with pytest.raises(TransferInputError, match=r"pages\[2\] = 3 appears twice"):
        check_pages(7, [3, 1, 3], 5, "pages", unique=True)


def test_registry_knows_every_designed_backend_and_loads_lazily() -> None:
    assert {"fake", "local", "mooncake", "nixl"} <= set(BACKENDS)
    assert get_backend("fake").name == "fake"
    assert issubclass(get_backend("local"), KVBackend)
    with pytest.raises(BackendError, match="unknown backend 'nope'; known: "):
        get_backend("nope")


def test_register_backend_and_broken_targets() -> None:
    register_backend("test-missing", "kvfsm.backends.does_not_exist:Thing")
    register_backend("test-not-a-backend", "kvfsm.backends.base:KVPools")
    try:
        with pytest.raises(BackendError, match=r"not available: importing kvfsm\.backends\.does_not_exist failed"):
            get_backend("test-missing")
        with pytest.raises(BackendError, match="is not a KVBackend subclass"):
            get_backend("test-not-a-backend")
    finally:
        BACKENDS.pop("test-missing")
        BACKENDS.pop("test-not-a-backend")
    with pytest.raises(TypeError, match="module:Class"):
        register_backend("x", "no-colon")


def test_import_kvfsm_does_not_import_backends_or_torch() -> None:
    code = (
        "import sys, kvfsm; "
        "assert 'kvfsm.backends' not in sys.modules, 'backends imported'; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_attribute_of_the_package_is_an_attribute_error() -> None:
    import kvfsm.backends as backends

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        backends.Nope  # noqa: B018


def test_backend_requires_a_manager_and_registered_pools() -> None:
    from kvfsm.backends.local import LocalBackend, LocalFabric

    with pytest.raises(TypeError, match=r"needs a kvfsm\.TransferManager"):
        LocalBackend("sender", fabric=LocalFabric())  # type: ignore[arg-type]
    manager = kvfsm.TransferManager("sender")
    with LocalBackend(manager, fabric=LocalFabric()) as backend:
        handle = manager.open(1)
        with pytest.raises(TransferInputError, match="register_pools\\(\\) was not called"):
            backend.bootstrap(handle, backend.address)
        assert handle.state is kvfsm.KVPoll.Failed
        with pytest.raises(BackendError, match="needs tensors"):
            backend.register_pools(KVPools([MemoryRegion(0, 100, 10)]))
    with pytest.raises(BackendError, match="is closed"):
        backend.register_pools(KVPools.from_tensors(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)))
