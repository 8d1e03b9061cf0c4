"""Errors the engine raises on purpose: each carries a message meant for the user."""


class EddyError(Exception):
    """Base class: the message is shown to the user as is."""


class ModelError(EddyError):
    """The model cannot be used: unsupported, missing or corrupt files."""


class ArtefactError(EddyError):
    """A compiled artefact is missing, stale or damaged."""


class PromptTooLongError(EddyError):
    """A single turn does not fit the cache window."""


class BuildCancelled(EddyError):
    """The user cancelled a build; nothing was cached."""


class DiskSpaceError(ArtefactError):
    """The disk lacks room for a build (checked before it starts) or filled up during it."""


class DeviceError(EddyError):
    """The device a model is built or run for is not there (no GPU, or an older one than the build's)."""
