"""``python -m autoprec``: the same as the ``autoprec`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
