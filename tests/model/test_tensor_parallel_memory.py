"""No tensor-parallel rank ever holds the whole base model in memory, host memory included: each rank's
peak anonymous memory while loading its part of a model large enough to show it (~260 MB of fp32
weights) is about half of what loading the whole model peaks at.

Measured per process (tests/model/load_memory_scenario.py), each rank alone, against a single rank's load
of the same files. Mapped safetensors pages are the page cache's, not the process's tensors, and are not
counted (RssAnon).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from tests.model.test_decoder_parity import save_random_hf_model

# hidden 512, 8 layers, MLP 2048, vocabulary 32000 untied: 66M parameters, 264 MB in fp32, most of it split
# (the norms every rank holds whole are 0.03% of it).
CONFIG = LlamaConfig(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    tie_word_embeddings=False,
)
# A rank's part is half of every split weight. Loading adds, at its peak, one tensor read before it is
# copied into place: at most the largest tensor's part (the 65 MB embedding's half), which a whole load
# pays in full too, so the peak share stays near one half; 0.6 leaves room for the allocator's rounding.
MAX_SHARE = 0.6


def _peak_load_bytes(model_dir: Path, rank: int, size: int) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.model.load_memory_scenario", str(model_dir), str(rank), str(size)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc (Linux)")
def test_no_rank_holds_the_whole_base_while_loading_its_part(tmp_path: Path) -> None:
    save_random_hf_model(CONFIG, tmp_path)
    whole = _peak_load_bytes(tmp_path, 0, 1)
    weights = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert whole >= 0.9 * weights  # the measure sees the whole model's tensors when they are all held
    for rank in (0, 1):
        part = _peak_load_bytes(tmp_path, rank, 2)
        assert part <= MAX_SHARE * whole, (rank, part, whole)
