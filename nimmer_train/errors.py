"""Errors the pipelines report as one clear line (no traceback unless HYDRA_FULL_ERROR=1)."""


class NimmerError(Exception):
    """A problem the user can fix: bad input, bad config, a missing folder. Says what and how."""


class ConfigError(NimmerError):
    """A config value that is wrong; the message starts with the full key."""

    def __init__(self, key: str, message: str | None = None) -> None:
        super().__init__(f"{key}: {message}" if message is not None else key)
        self.key = key
