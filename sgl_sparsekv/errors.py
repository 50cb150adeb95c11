"""The one error type of bad input: raised at startup, never mid-serving."""


class ConfigError(ValueError):
    """A bad ``--sparse-kv`` flag, config or model; the message is one line that names the culprit."""
