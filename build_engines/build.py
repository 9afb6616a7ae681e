#!/usr/bin/env python3
"""Build an engine directory from a HF checkpoint: `python build_engines/build.py --help`."""

import sys

from tritonllm.builder.cli import main

if __name__ == "__main__":
    sys.exit(main())
