"""The one error type that means "the user gave us something we cannot use"."""


class SpecError(ValueError):
    """Bad input: the CLI prints its message on one line and exits with status 2."""
