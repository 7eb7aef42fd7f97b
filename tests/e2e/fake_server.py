"""`loraplex serve` with the FakeEngine instead of the built-in model: same CLI, config and server code.

Run as `python -m tests.e2e.fake_server [serve options]`; the e2e fixture uses it while the real
engine is unavailable (or when LORAPLEX_E2E_ENGINE=fake).
"""

from __future__ import annotations

import logging
import sys

from loraplex.cli import build_parser, config_from_args, run_server
from tests.fakes import FakeEngine

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    config = config_from_args(build_parser().parse_args(["serve", *sys.argv[1:]]))
    run_server(config, FakeEngine(max_slots=config.max_slots))
