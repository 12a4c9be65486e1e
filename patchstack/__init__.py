# SPDX-License-Identifier: Apache-2.0
"""The vllm-ddtree patch-stack tool: a pinned vLLM release + patches/ + overlay/ ->
a patched tree, patches/ again, our wheel, a rebase report. `apply_patches.py` at
the repository root runs its command line.

Modules, each importing only modules above it:
  common   the repository's layout, DDTreeError, log
  lock     upstream.lock (Lock)
  fetch    PyPI's index, downloads into the cache, sha256 checks (`fetch`)
  repo     git: the pristine base repo in the cache, trees made from it
  overlay  overlay/ into a tree and back
  series   patches/series, a patch's message, the series' hash
  check    the rules for patches and overlay/ (`check`)
  apply    pristine tree + series + overlay/ -> build/src (`apply`)
  export   build/src -> patches/ and overlay/, the drift gate (`export`)
  replay   one patch replayed onto another release in a scratch repo: its fate
  report   the rebase report in Markdown
  rebase   the stack moved to another release: dry run, report, rewrite (`rebase`)
  wheel    our wheel repacked from the official one (`wheel`)
  lint     ruff with vLLM's settings (`lint`)
  cli      the command line (`version`, `wheel-name`, `series-hash`, `lock-get`)
"""
