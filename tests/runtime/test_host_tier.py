"""The host tier's default size: max-rank slots in half the host memory available at start-up."""

from loraplex.runtime.core.host_tier import available_host_bytes, default_host_slots


def test_the_default_fills_half_the_available_memory_with_whole_slots() -> None:
    assert default_host_slots(bytes_per_slot=100, available_bytes=1_000) == 5
    assert default_host_slots(bytes_per_slot=300, available_bytes=1_000) == 1  # 500 holds one, not 1.67
    assert default_host_slots(bytes_per_slot=600, available_bytes=1_000) == 0  # none fits: disk only


def test_without_a_figure_it_reads_the_memory_available_now() -> None:
    available = available_host_bytes()
    assert 0 < available < 1 << 50
    assert default_host_slots(1 << 20) >= default_host_slots(1 << 20, available // 2)
