"""``python -m umbp_redis.cli``: the ``umbp-redis`` command."""

import sys

from umbp_redis.cli.main import main

sys.exit(main())
