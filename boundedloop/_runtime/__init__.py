"""What every layer uses: batching and `shard_map` support, run-time checks,
progress, flat leaves, and the one module that imports JAX internals. Imports
nothing of the package."""

import os


# the package's folder: frames whose code is there are ours, not the user's
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
