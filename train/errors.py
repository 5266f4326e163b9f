"""User-facing errors: the CLIs print these as one line (no traceback) and exit with status 2."""


class UserError(Exception):
    """A mistake in the user's input, with a message that says what to do."""


class SharedUserError(UserError):
    """A UserError that every process of a launch raises, the main process having shared it (train.run.qlora.on_main):
    the first process, leaving, waits for the others however slow they are, since none is stuck waiting for it."""


def one_line(error: BaseException) -> str:
    """The first line of an error's message, for quoting a library's error inside a UserError."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
