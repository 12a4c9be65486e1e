# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One line for a configuration error at CLI startup.

vLLM's configs are pydantic dataclasses: a ``ValueError`` raised by a
config's ``__post_init__`` (a bad option, a method's refusal) reaches the CLI
as a multi-line ``ValidationError`` with the whole argument dump, at the end
of a long traceback. `exit_on_config_error` prints the config's own message
alone and exits with status 1, as argparse does for a bad argument; any other
exception is left to the caller. Generic: it knows no option or method.
"""

import sys

MAX_LINE = 500


def _validation_messages(exc: BaseException) -> list[str]:
    """The messages of a pydantic ``ValidationError``, or [] for any other
    exception (pydantic is not imported here: the CLI may fail before)."""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ != "ValidationError" or not callable(errors):
        return []
    messages = []
    for detail in errors():
        inner = (detail.get("ctx") or {}).get("error")
        if isinstance(inner, BaseException):
            message = str(inner)
        else:
            message = str(detail.get("msg", "")).removeprefix("Value error, ")
        location = ".".join(str(part) for part in detail.get("loc") or ())
        if location and not isinstance(inner, BaseException):
            message = f"{location}: {message}"
        messages.append(message)
    return messages


def config_error_line(exc: BaseException) -> str | None:
    """The configuration error carried by ``exc`` or its causes, as one line;
    None when none of them is a config's ``ValidationError``."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        err = pending.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        messages = [" ".join(m.split()) for m in _validation_messages(err)]
        messages = [m for m in messages if m]
        if messages:
            line = "; ".join(dict.fromkeys(messages))
            if len(line) > MAX_LINE:
                line = line[: MAX_LINE - 3] + "..."
            return line
        pending.extend(e for e in (err.__cause__, err.__context__) if e is not None)
    return None


def exit_on_config_error(exc: BaseException, prog: str = "vllm") -> None:
    """Exit with one line on stderr if ``exc`` is a configuration error;
    return (so that the caller re-raises) otherwise."""
    line = config_error_line(exc)
    if line is not None:
        sys.exit(f"{prog}: error: {line}")
