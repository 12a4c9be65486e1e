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

import json
import os
import sys
import urllib.error
import urllib.request
from urllib.parse import urlparse

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: load_served_pair.py BASE_URL PAIR_DIR", file=sys.stderr)
        return 2
    base, pair_dir = argv[0].rstrip("/"), os.path.abspath(argv[1])
    if urlparse(base).hostname not in LOOPBACK_HOSTS:
        print(f"load_served_pair: loopback servers only, got {base}", file=sys.stderr)
        return 2
    body = {
        "method": "load_embedded_pair",
        "args": [pair_dir, os.path.basename(pair_dir.rstrip("/"))],
        "timeout": 600,
    }
    req = urllib.request.Request(
        f"{base}/collective_rpc",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            results = json.loads(r.read() or b"{}").get("results")
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"load_served_pair: {base}/collective_rpc: {e}", file=sys.stderr)
        return 1
    if not results:
        print("load_served_pair: no worker answered", file=sys.stderr)
        return 1
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
