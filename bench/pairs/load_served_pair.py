#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Write an embedded benchmark pair into a running ``vllm serve`` started at the
production shape with dummy weights, as run_pairs.py does for an offline engine:

    env PYTHONPATH=$PWD VLLM_SERVER_DEV_MODE=1 vllm serve \\
        bench/pairs/models/dense-8b/production-target --load-format dummy \\
        --worker-extension-cls bench.pairs.pair_worker.EmbeddedPairWorker ...
    python3 -m bench.pairs.load_served_pair http://127.0.0.1:8000 \\
        bench/pairs/models/dense-8b

It POSTs ``load_embedded_pair`` to the server's ``/collective_rpc`` (a
development endpoint: ``VLLM_SERVER_DEV_MODE=1``), which every worker runs
(pair_worker.py; the drafter too when the server has one). Loopback servers
only; exit 0 when every worker answered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from urllib.parse import urlparse

import httpx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base_url")
    ap.add_argument("pair_dir")
    a = ap.parse_args(argv)
    base, pair_dir = a.base_url.rstrip("/"), os.path.abspath(a.pair_dir)
    if urlparse(base).hostname not in ("127.0.0.1", "::1", "localhost"):
        ap.error(f"loopback servers only, got {base}")
    body = {
        "method": "load_embedded_pair",
        "args": [pair_dir, os.path.basename(pair_dir.rstrip("/"))],
        "timeout": 600,
    }
    try:
        r = httpx.post(f"{base}/collective_rpc", json=body, timeout=900)
        r.raise_for_status()
        results = (r.json() if r.content else {}).get("results")
    except (httpx.HTTPError, ValueError) as e:
        print(f"load_served_pair: {base}/collective_rpc: {e}", file=sys.stderr)
        return 1
    if not results:
        print("load_served_pair: no worker answered", file=sys.stderr)
        return 1
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
