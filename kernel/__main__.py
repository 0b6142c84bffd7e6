"""``python -m shardbook.kernel -f CONNECTION_FILE``: run as one rank of a shardbook kernel."""

import sys

from shardbook.kernel.app import main

sys.exit(main())
