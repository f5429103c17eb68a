#!/usr/bin/env python3
"""Write a tiny random-weight HF-format checkpoint (same as `ringserve make-tiny-model`)."""

import sys

from ringserve.model.checkpoints.tiny import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
