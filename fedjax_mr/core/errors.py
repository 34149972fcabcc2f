"""Errors that name the bad input; the experiment binaries print them as one
line and exit non-zero (no traceback)."""


class UserError(ValueError):
  """Bad input from the user (a flag, a path, a config)."""


class ConfigError(UserError):
  """An invalid flag or configuration value."""


class DataError(UserError):
  """A dataset that is missing, unreadable or malformed."""


class NonFiniteError(RuntimeError):
  """Training produced a non-finite loss."""
