"""`to_device`: host data onto the device with its values and dtype, without a copy on the CPU and without
blocking the host on CUDA."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from loraplex.model.host_copy import to_device


def test_on_the_cpu_an_array_is_shared_not_copied() -> None:
    array = np.arange(6, dtype=np.int64).reshape(2, 3)
    tensor = to_device(array, "cpu")
    assert tensor.dtype == torch.int64 and tensor.tolist() == array.tolist()
    assert tensor.data_ptr() == array.ctypes.data


def test_a_read_only_array_is_copied_without_a_warning() -> None:
    array = np.arange(4, dtype=np.float32)
    array.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = to_device(array, None)
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert tensor.data_ptr() != array.ctypes.data


@pytest.mark.gpu
def test_on_cuda_the_copy_does_not_block_and_gives_the_values() -> None:
    array = np.arange(1000, dtype=np.int64)
    torch.cuda.set_sync_debug_mode("error")  # a blocking copy from pageable memory would raise
    try:
        tensors = [to_device(array, "cuda"), to_device(torch.from_numpy(array), "cuda")]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for tensor in tensors:
        assert tensor.device.type == "cuda" and torch.equal(tensor.cpu(), torch.from_numpy(array))
