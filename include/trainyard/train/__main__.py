"""``python -m trainyard.train``: runs ``python -m trainyard.workload`` (the name specs used before)."""

import sys

from trainyard.workload.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
