"""What every layer uses (see `docs/architecture.md`). Imports nothing of the
package."""

import os


# the package's folder: frames whose code is there are ours, not the user's
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
