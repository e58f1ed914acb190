"""What to install for an optional package: the one table of mmproxy's extras, for the errors
that name one."""

from __future__ import annotations

__all__ = ["install_hint"]

# optional package (its import name) -> the extra of mmproxy's that installs it, and its name on PyPI
_EXTRAS = {"matplotlib": ("plot", "matplotlib"), "av": ("video", "av"), "boto3": ("s3", "boto3"),
           "botocore": ("s3", "botocore"), "moto": ("test", "moto"),
           "PyNvVideoCodec": ("nvdec", "pynvvideocodec"), "torchcodec": ("torchcodec", "torchcodec")}


def install_hint(module: str) -> str:
    """``pip install PACKAGE``, and the extra of mmproxy's that holds it, for ``module`` (an import
    name; mmproxy is installed from its checkout, so ``pip install 'mmproxy[x]'`` would not do)."""
    top = module.split(".")[0]
    extra, package = _EXTRAS.get(top, (None, top))
    return f"pip install {package}" + (f" (mmproxy's [{extra}] extra)" if extra else "")
