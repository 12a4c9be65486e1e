# SPDX-License-Identifier: Apache-2.0
"""The vllm-ddtree patch-stack tool: a pinned vLLM release + patches/ + overlay/ ->
a patched tree, patches/ again, our wheel, a rebase report. `apply_patches.py` at
the repository root runs its command line (cli).

Modules, each a step of its own:
  common   the repository's layout, DDTreeError, log
  lock     upstream.lock (Lock)
  fetch    PyPI's index, downloads into the cache, sha256 checks (`fetch`)
  repo     git: the pristine base repo in the cache, trees made from it
  series   patches/series, a patch's message, the series' hash
  overlay  overlay/ into a tree and back
  check    the rules for patches and overlay/ (`check`)
  apply    pristine tree + series + overlay/ -> build/src (`apply`)
  export   build/src -> patches/ and overlay/, the drift gate (`export`)
  rebase   the stack replayed onto another release (`rebase`)
  report   the rebase report in Markdown
  wheel    our wheel repacked from the official one (`wheel`)
  lint     ruff with vLLM's settings (`lint`)
  cli      the command line (`version`, `wheel-name`, `series-hash`, `lock-get`)
"""
