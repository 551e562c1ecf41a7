"""A stand-in for ``torchvision`` (tests only): PyPI's build does not load beside torch's CPU
build ("operator torchvision::nms does not exist"), and SGLang and transformers import it at
module level once it is found. Only the names they import exist; nothing here is called on a
text model, and what would be raises."""

from . import io, transforms

__all__ = ["io", "transforms"]

__version__ = "0.0.0"  # transformers reads it; no version check passes, so no new-API path
