"""What every config section shares: unknown keys are errors, every field documented in place."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from echo2.errors import Echo2InputError


class ConfigError(Echo2InputError):
    """The config file or an override is invalid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


_DEVICE = re.compile(r"auto|cpu|meta|cuda(:\d+)?")


def check_device_name(value: str) -> str:
    """A device setting's value (``learner.device``, ``rollout.engine.device``): auto, cpu, cuda or cuda:N (meta: the
    tests' placement check). Whether CUDA is there is checked where the device is used (``echo2/devices.py``)."""
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"{value!r} is not a device: auto, cpu, cuda or cuda:N")
    return value
