"""`serve --compile` and `--cuda-graphs` reach the engine: the option, the worker ranks' options, the engine
it builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import cli
from loraplex.config import ServerConfig
from loraplex.errors import UserError
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


def test_serve_cuda_graphs_reaches_the_worker_ranks_and_on_is_refused_on_a_cpu(tmp_path: Path) -> None:
    def config(*option: str) -> ServerConfig:
        serve = ["serve", "--device", "cpu", "--data-dir", str(tmp_path), *option]
        return cli.config_from_args(cli.build_parser().parse_args(serve))

    worker_options = cli.config_to_args(config("--cuda-graphs", "off"), cli._ENGINE_OPTIONS)
    assert worker_options[worker_options.index("--cuda-graphs") + 1] == "off"
    assert cli._engine_builder(config())("cpu", SINGLE).sampler.graphs is None  # auto: CUDA only
    with pytest.raises(UserError, match="--cuda-graphs on: the device is not CUDA"):
        cli._engine_builder(config("--cuda-graphs", "on"))("cpu", SINGLE)
