"""Errors a user can fix: bad configs and bad data.

Entry points catch `UserError`, print its message as one line (no stack trace) and exit
non-zero. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
  """A problem in the user's input; the message says what to change."""


class ConfigError(UserError):
  """An invalid or inconsistent configuration value."""


class DataError(UserError):
  """Missing, malformed or inconsistent data files."""
