#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The vllm-ddtree patch-stack tool (`python3 apply_patches.py --help`); its code is
the patchstack package beside this file."""

import sys

from patchstack.cli import main

if __name__ == "__main__":
    sys.exit(main())
