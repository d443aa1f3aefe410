"""The index's error (its own module, so that every part of the index can raise it)."""


class AdIndexError(ValueError):
    """An invalid index operation or snapshot; the index is unchanged when this is raised."""
