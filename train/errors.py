"""User-facing errors: the CLIs print these as one line (no traceback) and exit with status 2."""


class UserError(Exception):
    """A mistake in the user's input, with a message that says what to do."""
