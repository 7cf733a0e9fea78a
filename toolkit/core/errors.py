"""One error type for bad input: the CLIs print its message on one line and exit non-zero."""

from __future__ import annotations

import sys
from typing import Callable


class ToolkitError(Exception):
    """A user-facing error. Its message is one line that says what is wrong and with which value."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def run_cli(main: Callable[[], object]) -> None:
    """Run a CLI entry point: a ToolkitError becomes `error: <message>` on stderr and exit 2."""
    try:
        result = main()
    except ToolkitError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(result if isinstance(result, int) else 0)
