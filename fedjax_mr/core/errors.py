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


class ArgumentError(ValueError):
  """A library function's bad argument, named: `str(e)` reads
  '<argument> <message>'. The experiment maps `argument` to its flag."""

  def __init__(self, argument: str, message: str):
    super().__init__(f'{argument} {message}')
    self.argument = argument
    self.message = message
