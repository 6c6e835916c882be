"""``python -m megatron_cascade.convert <subcommand> ...`` (same as ``megatron-cascade convert ...``)."""

import sys

from megatron_cascade.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
