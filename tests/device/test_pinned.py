"""Large pinned buffers (`device/pinned.py`) pin exactly their own bytes and let go of them when the
last tensor viewing them is freed. On the CPU the registration calls are stand-ins that record
what CUDA would be asked (the lifetime logic is ours; CUDA cannot run here); the `gpu` tests run
the same with the CUDA runtime."""

import gc

import pytest
import torch

from tiered_cache.device.pinned import LARGE_BYTES, PinRefused, RegisteredMapping, pinned_empty


class Driver:
    """Records registrations as CUDA would hold them: address -> size."""

    def __init__(self, refuse: int = 0) -> None:
        self.held: dict[int, int] = {}
        self.registered: list[int] = []
        self.refuse = refuse

    def register(self, address: int, size: int) -> int:
        if self.refuse:
            return self.refuse
        assert address not in self.held, "registered twice"
        self.held[address] = size
        self.registered.append(size)
        return 0

    def unregister(self, address: int) -> int:
        assert address in self.held, "unregistered what was not registered"
        del self.held[address]
        return 0


def test_a_large_buffer_pins_its_own_size_and_is_released_with_its_last_view():
    driver = Driver()
    shape = (37, 2, 16, 1024)  # 37 pages: 4.6 MiB each in bf16, not a power of two in all
    nbytes = 37 * 2 * 16 * 1024 * 2 * 30
    buffer = pinned_empty((30, *shape), torch.bfloat16, driver.register, driver.unregister)
    assert nbytes >= LARGE_BYTES and nbytes & (nbytes - 1)
    assert driver.registered == [nbytes]  # not rounded up to the next power of two
    assert buffer.shape == (30, *shape) and buffer.dtype == torch.bfloat16 and buffer.is_contiguous()
    buffer.fill_(2.0)
    row = buffer[29, 36]  # a view outlives the tensor it came from ...
    del buffer
    gc.collect()
    assert len(driver.held) == 1 and torch.all(row == 2.0)  # ... and the pages stay pinned under it
    row.add_(1.0)
    del row
    gc.collect()
    assert driver.held == {}  # unregistered once, when nothing views it


def test_every_byte_of_a_buffer_is_its_own():
    """Two buffers never share memory: writes into one leave the other as written."""
    driver = Driver()
    a = pinned_empty((LARGE_BYTES,), torch.uint8, driver.register, driver.unregister)
    b = pinned_empty((LARGE_BYTES // 2,), torch.int16, driver.register, driver.unregister)
    a.fill_(7)
    b.fill_(-3)
    assert int(a.min()) == int(a.max()) == 7 and int(b.min()) == int(b.max()) == -3
    assert len(set(driver.held)) == 2


def test_a_refused_registration_unmaps_and_says_so():
    driver = Driver(refuse=1)
    with pytest.raises(PinRefused) as refused:
        RegisteredMapping(LARGE_BYTES, driver.register, driver.unregister)
    assert refused.value.args[0] == 1 and driver.held == {}


@pytest.mark.gpu
def test_on_cuda_a_large_buffer_is_pinned_outside_torchs_rounding_allocator():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    stats = torch.cuda.memory.host_memory_stats
    before = stats().get("allocated_bytes.current", 0) if callable(stats) else 0
    nbytes = 3 * LARGE_BYTES + 4096  # rounded by torch's allocator, it would pin 256 MiB
    buffer = pinned_empty((nbytes,), torch.uint8)
    assert buffer.is_pinned()
    if callable(stats):
        assert stats().get("allocated_bytes.current", 0) == before  # not through torch's allocator
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    on_device = buffer.to("cuda", non_blocking=True)
    back = torch.empty_like(buffer)
    back.copy_(on_device)
    torch.cuda.synchronize()
    assert torch.equal(back, buffer)
