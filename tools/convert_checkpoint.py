#!/usr/bin/env python
"""Convert checkpoints without the main CLI: ``python tools/convert_checkpoint.py <subcommand> ...``.

Same subcommands and flags as ``megatron-cascade convert`` (see tools/README.md):
hf-to-megatron, megatron-to-hf, reshard, nemo2-to-megatron, compare, inspect.
"""

import sys

from megatron_cascade.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
