"""Errors that reach the user as one line (the CLI prints the message and exits non-zero)."""


class PfedkitError(Exception):
    """Base class: a problem the user can fix; the message says what and how."""


class ConfigError(PfedkitError):
    """A config key or value is wrong; the message names the key and the allowed values."""


class DataError(PfedkitError):
    """A dataset is missing or malformed; the message says where we looked and how to get it."""


class UpdateError(PfedkitError):
    """A client sent a malformed or non-finite update."""


FAILED_FILE = "failed.txt"  # a run folder's record of the UpdateError that stopped it
