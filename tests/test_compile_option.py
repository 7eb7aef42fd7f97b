"""`serve --compile` reaches the decoder: the option, the worker ranks' options, the engine it builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import cli
from loraplex.model.elementwise import EAGER, fused
from loraplex.model.tensor_parallel import SINGLE


@pytest.mark.parametrize(("option", "fuses_on_cpu"), [([], False), (["--compile", "on"], True)])
def test_serve_compile_reaches_the_decoder_and_the_worker_ranks(
    option: list[str], fuses_on_cpu: bool, tmp_path: Path
) -> None:
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "--data-dir", str(tmp_path), *option])
    config = cli.config_from_args(args)
    worker_options = cli.config_to_args(config, cli._ENGINE_OPTIONS)
    assert worker_options[worker_options.index("--compile") + 1] == ("on" if fuses_on_cpu else "auto")
    decoder = cli._engine_builder(config)("cpu", SINGLE).decoder
    assert decoder.elementwise is (fused() if fuses_on_cpu else EAGER)
    assert decoder.model.layers[0].self_attn.q_norm.elementwise is decoder.elementwise
