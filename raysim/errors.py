"""User-facing errors. The CLI prints them as one line and exits non-zero; no traceback."""


class RaysimError(Exception):
    """Base class of errors caused by input (config, data), not by a bug."""


class ConfigError(RaysimError):
    """A config value is invalid; the message starts with the key path."""


class DataError(RaysimError):
    """A dataset could not be found or read; the message names the files and places tried."""


class PartitionError(RaysimError):
    """A partition cannot be made from this dataset; the message names the config fields."""
