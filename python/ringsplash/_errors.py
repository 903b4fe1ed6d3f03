"""The package's exception types.

Every error ringsplash raises is a ``ringsplash.Error``; the concrete types are
also the built-in ones a caller may already catch: a bad value or shape is an
``InvalidArgumentError`` (a ``ValueError``), a wrong element type a
``DTypeError`` (a ``TypeError``). Errors found by the C++ library carry its
message unchanged (which argument, what was expected, what was given).
"""


class Error(Exception):
    """Base class of every ringsplash error."""


class InvalidArgumentError(Error, ValueError):
    """An argument has the wrong shape, value or combination with others."""


class DTypeError(Error, TypeError):
    """An array has an element type ringsplash does not take."""
