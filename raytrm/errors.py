"""The one error type a user can meet: printed as one line by the CLI, exit code 2."""

from __future__ import annotations

import reprlib

#: How a received value is shown in an error: a few items of each container, short strings, a few levels deep.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 2, 60, 40, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 5


#: The fields an error lists before "(and N more fields)": more would bury the first in a line nobody reads to its end.
SHOWN_FIELDS = 6


class UserError(Exception):
    """Bad input from the user: a file, a flag, a dataset, an address.

    The message is a single line that names what was wrong and how to fix it; the CLI prints it without a
    traceback and exits with code 2.
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class ConfigError(UserError):
    """A config or profile value that does not validate."""

    def __init__(self, source: str, path: str, received: object, expected: str, fix: str = "") -> None:
        self.source, self.path, self.received, self.expected, self.fix = source, path, received, expected, fix
        where = f"{source}: {path}" if path else source
        tail = f"; fix: {fix}" if fix else ""
        # Shortened: a value of a million items (or a YAML alias bomb) is no clearer, and would take forever to show.
        super().__init__(f"{where}: got {_SHORT.repr(received)}, expected {expected}{tail}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its fields, so it crosses process boundaries (a Ray worker's error reaching the driver).
        return (type(self), (self.source, self.path, self.received, self.expected, self.fix))
