"""The one error type that means "the user gave us something we cannot use"."""


class SpecError(ValueError):
    """Bad input: the CLI prints its message on one line and exits with status 2."""


class Aborted(SpecError):
    """The caller's `abort()` said stop (a client left, a deadline passed) during a prefill."""
