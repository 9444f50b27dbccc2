"""What stops an ingest run before it reads anything, besides the broker's own errors."""


class IngestError(Exception):
    """The run cannot start or cannot commit; the message says what to do."""
