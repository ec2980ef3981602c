"""Errors that mean "the user gave us something wrong": the CLI prints one line and exits 2."""


class Echo2InputError(Exception):
    """Bad input from the user (config, model, store): reported as one line, exit code 2."""


class ModelNotFound(Echo2InputError):
    """The configured model is neither a local directory, the embedded default, nor in the HF cache."""


class StoreUnreachable(Echo2InputError):
    """The object store URL cannot be reached or is not usable."""
