# SPDX-License-Identifier: Apache-2.0
"""vLLM's engine config as `vllm serve` builds it, on a machine without a GPU:
the scripts that the tests run in a subprocess (each start imports vLLM)
with their RESULT line, `vllm serve` itself, and a stand-in for the parts of
a VllmConfig that DDTree's engine-level checks read."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

# The CUDA wheel cannot infer a device without a GPU (DeviceConfig fails while
# the engine config, or the CLI's argument parser, is built), so a script sets
# vLLM's CPU platform first, as `vllm bench` does in the same main().
CPU_PLATFORM = """
from vllm import platforms
from vllm.platforms.cpu import CpuPlatform
if platforms.current_platform.is_unspecified():
    platforms.current_platform = CpuPlatform()
"""

# `vllm serve` exactly as the console script runs it, on the CPU platform.
CLI_ON_CPU = (
    CPU_PLATFORM
    + """
import sys
from vllm.entrypoints.cli.main import main
sys.argv = ['vllm', *sys.argv[1:]]
main()
"""
)


def cpu_env(logging_level="ERROR", unset=()):
    """The environment of a subprocess that sees no GPU, without ``unset``."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", VLLM_LOGGING_LEVEL=logging_level)
    for name in unset:
        env.pop(name, None)
    return env


def run_on_cpu(script, *args, timeout=600, unset=()):
    """Run ``script`` on vLLM's CPU platform with ``args`` as sys.argv[1:];
    returns what it printed as ``RESULT <json>``."""
    p = subprocess.run(
        [sys.executable, "-c", CPU_PLATFORM + script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cpu_env(unset=unset),
    )
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return json.loads(line[len("RESULT ") :])


def engine_config(**fields):
    """The parts of a VllmConfig that DDTree's engine-level checks read, with
    ``fields`` in place of the defaults."""
    from vllm.config import AttentionConfig, CacheConfig

    engine = dict(
        speculative_config=None,
        attention_config=AttentionConfig(),
        cache_config=CacheConfig(),
        model_config=None,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, data_parallel_size=1, tensor_parallel_size=1
        ),
        scheduler_config=None,
        compilation_config=None,
        kv_transfer_config=None,
    )
    engine.update(fields)
    return SimpleNamespace(**engine)
