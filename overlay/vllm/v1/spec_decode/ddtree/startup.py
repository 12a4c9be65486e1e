# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One readable line for a bad DDTree configuration at startup.

The DDTree checks (``ddtree/config.py``) raise ``ValueError("DDTree: ...")``
from ``SpeculativeConfig.__post_init__`` and ``VllmConfig.__post_init__``.
Both are pydantic dataclasses, so the message reaches ``vllm serve`` wrapped
in a multi-line ``ValidationError`` (with the whole argument dump) at the end
of a long traceback. The CLI hook calls :func:`exit_on_ddtree_config_error`,
which prints the DDTree message alone and exits with status 1. When
``--speculative-config`` asks for DDTree and upstream's own validation of the
speculative config fails first (e.g. a drafter that is not a DFlash model is
refused while its config is wrapped, before our check runs), that error is
shortened to one line too. Any other exception is left alone.
"""

import re
import sys

from vllm.entrypoints.cli.config_errors import exception_chain

DDTREE_PREFIX = "DDTree"


def _messages(exc: BaseException) -> list[str]:
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        out = []
        try:
            details = errors()
        except Exception:  # pragma: no cover - defensive
            details = []
        for detail in details:
            inner = (detail.get("ctx") or {}).get("error")
            if isinstance(inner, BaseException):
                out.append(str(inner))
            else:
                msg = str(detail.get("msg", ""))
                out.append(msg.removeprefix("Value error, "))
        return out
    return [str(exc)] if exc.args else []


def ddtree_config_error_line(exc: BaseException) -> str | None:
    """The DDTree configuration message carried by ``exc`` (or its causes),
    as one line; None when ``exc`` is not a DDTree configuration error."""
    for err in exception_chain(exc):
        if isinstance(err, (ValueError, TypeError)):
            for message in _messages(err):
                line = " ".join(message.split())
                if line.startswith(DDTREE_PREFIX):
                    return line
    return None


MAX_LINE = 300
_ARCH_RE = re.compile(r"Model architectures \[([^\]]*)\] are not supported")


def _speculative_config_error(exc: BaseException) -> str | None:
    """First message of a failed SpeculativeConfig validation in ``exc``."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        err = pending.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        if (
            type(err).__name__ == "ValidationError"
            and getattr(err, "title", None) == "SpeculativeConfig"
        ):
            messages = [" ".join(m.split()) for m in _messages(err)]
            if messages and messages[0]:
                return messages[0]
        pending.extend(e for e in (err.__cause__, err.__context__) if e is not None)
    return None


def not_a_dflash_drafter_line(message: str, model: object) -> str | None:
    """The DDTree line for upstream's refusal of the draft model's
    architecture in ``message`` (the drafter is not a DFlash model); None
    for any other message."""
    arch = _ARCH_RE.search(message)
    if arch is None:
        return None
    return (
        f"DDTree: the draft model {model!r} is not a DFlash drafter "
        f"(resolved architectures [{arch.group(1)}]); use a DFlash "
        "checkpoint (DFlashDraftModel with a dflash_config)."
    )


def ddtree_spec_error_line(
    exc: BaseException, speculative_config: object
) -> str | None:
    """One line for an upstream speculative-config error of a DDTree request."""
    if not isinstance(speculative_config, dict):
        return None
    if speculative_config.get("method") != "ddtree":
        return None
    message = _speculative_config_error(exc)
    if message is None:
        return None
    line = not_a_dflash_drafter_line(message, speculative_config.get("model"))
    if line is not None:
        return line
    line = f"DDTree: invalid --speculative-config: {message}"
    if len(line) > MAX_LINE:
        line = line[: MAX_LINE - 3] + "..."
    return line


def exit_on_ddtree_config_error(
    exc: BaseException, prog: str = "vllm", speculative_config: object = None
) -> None:
    """Exit with one line on stderr if ``exc`` is a DDTree configuration
    error; return (so the caller re-raises) otherwise."""
    line = ddtree_config_error_line(exc)
    if line is None:
        line = ddtree_spec_error_line(exc, speculative_config)
    if line is not None:
        sys.exit(f"{prog}: error: {line}")
