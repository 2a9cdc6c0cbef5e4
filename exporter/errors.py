"""The one exception type the exporter raises for bad input; the CLI prints it as one line."""


class ExportError(Exception):
    """A problem with the user's input or environment, explained in one line."""
