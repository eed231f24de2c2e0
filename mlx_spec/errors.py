"""The one error type that means "the user gave us something we cannot use"."""


class SpecError(ValueError):
    """Bad input: the CLI prints its message on one line and exits with status 2."""


def one_line(err: BaseException | str, *, reason: bool = False) -> str:
    """`err`'s message with its white space folded onto one line; `reason`: an OSError's
    reason alone (its strerror), where the surrounding message names the file already."""
    text = (reason and getattr(err, "strerror", None)) or str(err)
    return " ".join(text.split())
