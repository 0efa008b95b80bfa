"""The exceptions for bad input. Every message is one line that names the file and the tensor,
parameter or config key; the command line prints it and exits 2."""


class CheckpointError(ValueError):
    """A checkpoint, config or destination that cannot be used as asked."""


class ConfigError(CheckpointError):
    """A config that this implementation cannot reproduce exactly, or a value of the wrong type."""


class IntegrityError(CheckpointError):
    """A file of a written checkpoint is missing, truncated or altered since it was recorded."""


def one_line(e: BaseException) -> str:
    """An exception's message as one line: OS errors name their file; a library's multi-line
    text is joined (and cut at 2,000 characters)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."
