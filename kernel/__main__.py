"""``python -m shardbook.kernel -f CONNECTION_FILE``: run as one rank of a shardbook kernel."""

import sys

from .app import main

sys.exit(main())
