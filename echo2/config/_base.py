"""What every config section shares: unknown keys are errors, every field documented in place."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from echo2.errors import Echo2InputError


class ConfigError(Echo2InputError):
    """The config file or an override is invalid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
