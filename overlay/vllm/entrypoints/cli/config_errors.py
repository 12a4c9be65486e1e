# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One line for a configuration error at CLI startup.

vLLM's configs are pydantic dataclasses: a ``ValueError`` raised by a
config's ``__post_init__`` (a bad option, a method's refusal) reaches the CLI
as a multi-line ``ValidationError`` with the whole argument dump, at the end
of a long traceback. `install_config_error_excepthook` makes such an uncaught
error of the ``vllm`` CLI print the config's own message alone, as argparse
does for a bad argument (the interpreter exits with status 1 after an
uncaught exception); any other exception, and any other program, goes to the
previous hook unchanged. A general plugin installs it: vLLM loads those in
the CLI process while it builds the argument parser, before any config.
Generic: it knows no option or method.
"""

import os
import sys
from collections.abc import Iterator
from types import TracebackType

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


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes and contexts, breadth first, each once."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        err = pending.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        pending.extend(e for e in (err.__cause__, err.__context__) if e is not None)


def config_error_line(exc: BaseException) -> str | None:
    """The configuration error carried by ``exc`` or its causes, as one line;
    None when none of them is a config's ``ValidationError``."""
    for err in exception_chain(exc):
        messages = [" ".join(m.split()) for m in _validation_messages(err)]
        messages = [m for m in messages if m]
        if messages:
            line = "; ".join(dict.fromkeys(messages))
            if len(line) > MAX_LINE:
                line = line[: MAX_LINE - 3] + "..."
            return line
    return None


def cli_prog(argv: list[str]) -> str | None:
    """``vllm <subcommand>`` when ``argv`` is the ``vllm`` CLI's, else None
    (a Python program that uses vLLM keeps its traceback)."""
    if not argv or os.path.basename(argv[0]) != "vllm":
        return None
    if len(argv) > 1 and not argv[1].startswith("-"):
        return f"vllm {argv[1]}"
    return "vllm"


def install_config_error_excepthook() -> None:
    """Wrap ``sys.excepthook`` once: an uncaught configuration error of the
    ``vllm`` CLI is printed as ``vllm <subcommand>: error: <message>``."""
    previous = sys.excepthook
    if getattr(previous, "prints_config_errors", False):
        return

    def excepthook(
        exc_type: type[BaseException],
        exc: BaseException,
        tb: TracebackType | None,
    ) -> None:
        prog = cli_prog(sys.argv)
        line = None
        if prog is not None and isinstance(exc, Exception):
            line = config_error_line(exc)
        if line is None:
            previous(exc_type, exc, tb)
        else:
            print(f"{prog}: error: {line}", file=sys.stderr)

    excepthook.prints_config_errors = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook
