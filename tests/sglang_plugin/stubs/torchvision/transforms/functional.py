"""Functional transforms: names only (every function raises)."""


def _missing(*args, **kwargs):
    raise NotImplementedError("torchvision.transforms.functional: the tests' stub")


pil_to_tensor = to_tensor = resize = normalize = pad = crop = grayscale_to_rgb = _missing


def __getattr__(name):
    if name == "InterpolationMode":  # imported from here too; defined in the package
        from . import InterpolationMode

        return InterpolationMode
    raise AttributeError(name)
