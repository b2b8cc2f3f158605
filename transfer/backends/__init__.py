"""Transfer backends; importing this package registers every one of them."""

from transfer.backends import fake  # noqa: F401
