"""Errors a user can fix. The CLI prints them as one line and exits 2, without a traceback."""


class UserError(Exception):
    """Bad input: a config value, a file, an address. The message says what and how to fix it."""


class ConfigError(UserError):
    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)
