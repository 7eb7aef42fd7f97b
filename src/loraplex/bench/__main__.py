"""`python -m loraplex.bench train|optim ...`: the bench subcommands without the `loraplex` command."""

import sys

from loraplex.bench.cli import main

sys.exit(main())
