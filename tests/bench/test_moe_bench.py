"""`loraplex bench train` on an MoE preset: it runs end to end and counts the parameters a token passes."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.bench.cli import main

# The `smoke-moe` preset by hand: attention q 64·64 + k, v 64·32 each + o 64·64 in both layers; layer 0
# sparse: router 64·8 and its 2 picked experts of 3·64·32; layer 1 dense: 3·64·128; lm_head 64·512.
ATTENTION = 64 * 64 + 2 * 64 * 32 + 64 * 64
SMOKE_MOE_MATMUL_PARAMS = 2 * ATTENTION + (64 * 8 + 2 * 3 * 64 * 32) + 3 * 64 * 128 + 64 * 512


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_train_on_an_moe_preset_counts_the_router_and_picked_experts_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", "--model", "smoke-moe", "--rounds", "1", "--threads", "1", "--device", "cpu", "--json"]
    assert main([*argv, "--slots", "2", "--tokens-per-slot", "6", "--rank", "4"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["matmul_params"] == SMOKE_MOE_MATMUL_PARAMS
    assert summary["flops_per_token"] == 4 * SMOKE_MOE_MATMUL_PARAMS
    assert summary["tokens_per_s"] > 0 and summary["speedup_vs_naive_peft"] > 0
