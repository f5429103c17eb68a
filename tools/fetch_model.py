#!/usr/bin/env python3
"""Build the local HF-format copy of a known model (same as `ringserve fetch-model`)."""

import sys

from ringserve.model.checkpoints.fetch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
