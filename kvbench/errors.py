"""One error type for bad input: the message names the bad value and the accepted ones."""


class ConfigError(ValueError):
    """Raised for invalid user input (config values, names, budgets). The CLI prints it as one line."""


def unknown_name(kind: str, value: str, accepted) -> ConfigError:
    return ConfigError(f"unknown {kind} '{value}'; accepted: {', '.join(sorted(accepted))}")
