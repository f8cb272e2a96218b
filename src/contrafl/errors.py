"""User-facing errors.

Every error a user can cause (a bad configuration value, a missing or corrupted data file,
a client update that cannot be aggregated) is raised as a :class:`ContraflError`. The CLI
prints its message as one line and exits with status 2; it never shows a traceback for them.
Messages name the offending value, say what was expected and how to fix it.
"""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of an exception (for summaries and logs)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class ContraflError(Exception):
    """Base class of errors caused by user input."""


class ConfigError(ContraflError, ValueError):
    """An invalid configuration value."""


class DataError(ContraflError):
    """A dataset file that is missing, truncated, corrupted or in the wrong format."""


class ClientUpdateError(ContraflError):
    """A client update that cannot be aggregated (non-finite values, wrong shapes)."""


class CheckpointError(ContraflError):
    """A checkpoint or client-state file that is missing, corrupted, unsafe or belongs to
    another configuration."""
