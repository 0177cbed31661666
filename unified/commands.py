"""Running a command: our errors become one line on stderr and an exit code.

`run_command` is what every command runs under: the `unified` command line (`unified.cli`) and
the commands other packages contribute (`unified tinker-serve`, the examples' scripts). A usage
error (bad config, data, import path or capability) prints one line and exits 2; a run that
cannot make progress exits 1 with the reason; an interrupted run exits with its signal's code
(130 for Ctrl-C, 143 for SIGTERM); any other exception prints a one-line summary, then its
traceback. Secrets are masked in everything printed.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable

from unified.errors import TrainingInterrupted, UnifiedError, UsageError
from unified.redaction import RedactingHandler, redact

__all__ = ["run_command"]


def run_command(command: Callable[[], int], prog: str = "unified") -> int:
    """Run `command`; turn our errors into one line on stderr and the matching exit code.

    Any other exception is a bug in user code (a workflow) or ours: a one-line summary, then its
    traceback, which the user needs to fix it. Secrets are masked in everything printed.
    """
    _log_with_secrets_masked()
    try:
        return command()
    except UsageError as e:
        print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.exit_code
    except UnifiedError as e:
        said = "; ".join([str(e), *getattr(e, "__notes__", ())])
        print(f"{prog}: {type(e).__name__}: {_one_line(said)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        notes = "; ".join(getattr(e, "__notes__", ()))
        summary = f"{type(e).__name__}: {str(e) or '(no message)'}"
        if notes:
            summary += f" ({notes})"
        print(f"{prog}: error: {_one_line(summary)}; its traceback follows", file=sys.stderr)
        print(redact("".join(traceback.format_exception(e))), file=sys.stderr, end="")
        return 1


def _one_line(text: str) -> str:
    """`text` on one line, secrets masked: error messages may quote multi-line causes."""
    return redact(" ".join(line.strip() for line in text.splitlines() if line.strip()))


def _log_with_secrets_masked() -> None:
    """Send log records (warnings and up, tracebacks included) to stderr with secrets masked,
    unless the host program configured logging itself (as `logging.basicConfig` would)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = RedactingHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.setLevel(logging.WARNING)
        root.addHandler(handler)
