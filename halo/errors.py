"""Domain errors. Every message says what is wrong *and* what to do about it."""


class HaloError(Exception):
    """Base class: anything halo raises on purpose."""


class ModelFormatError(HaloError):
    """A model or tokenizer file is missing, truncated, malformed or unsupported."""

    def __init__(self, path, problem: str, fix: str = ""):
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        message = f"{self.path}: {problem}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)


class ConfigError(HaloError):
    """A setting given by the user is out of range or inconsistent."""
