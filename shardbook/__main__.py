"""``python -m shardbook COMMAND ...``: the ``shardbook`` command line,
as torchrun can start it (``-m shardbook chat``)."""

import sys

from shardbook.kernel.cli.main import main

sys.exit(main())
