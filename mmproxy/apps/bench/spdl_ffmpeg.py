"""SPDL's FFmpeg: the libraries SPDL's media library (``spdl.io``) decodes with, the system's or,
where the system has none SPDL was built for, PyAV's bundled copy, loaded in this process.
docs/internals.md, ``mmproxy.apps.bench.spdl_ffmpeg``, has the rest.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
from pathlib import Path

__all__ = ["FFMPEG_ENV", "load_cuda_build", "load_errors", "load_ffmpeg"]

FFMPEG_ENV = "MMPROXY_SPDL_FFMPEG"  # "pyav", "system", or unset: the system's, else PyAV's

_LIBS = ("avutil", "swresample", "swscale", "avcodec", "avformat", "avfilter", "avdevice")  # deps first
_BUNDLED = re.compile(r"^lib(" + "|".join(_LIBS) + r")-[0-9a-f]+\.so\.(\d+)[.\d]*$")
_NONE = "SPDL loads none of its FFmpeg builds (FFmpeg 4 to 9)"
_loaded: dict[str, str] = {}  # "build": the SPDL extension PyAV's FFmpeg was loaded for
_handles: list[ctypes.CDLL] = []  # kept loaded for the process's life


class _OtherBuild(RuntimeError):
    """SPDL took another build than the one PyAV's FFmpeg was loaded for."""


def load_ffmpeg() -> str:
    """Loads SPDL's FFmpeg build (once a process; module docstring) and says whose it is:
    ``"the system's FFmpeg 5 (libavcodec 59.37.100)"`` or ``"PyAV's bundled FFmpeg 8
    (libavcodec 62.28.102)"``.

    Raises:
        RuntimeError: no build loads (each build's reason, and why PyAV's FFmpeg could not serve),
            or :data:`FFMPEG_ENV` asks for PyAV's and SPDL has already loaded another.
        ValueError: :data:`FFMPEG_ENV` is neither ``pyav`` nor ``system``.
    """
    choice = os.environ.get(FFMPEG_ENV, "")
    if choice not in ("", "pyav", "system"):
        raise ValueError(f"{FFMPEG_ENV}={choice!r}: use 'pyav' (PyAV's bundled FFmpeg), 'system', "
                         "or leave it unset (the system's, else PyAV's)")
    if choice == "pyav" and not _loaded:
        if _loaded_build() is not None:
            raise RuntimeError(f"{FFMPEG_ENV}=pyav, but SPDL has already loaded the system's "
                               f"FFmpeg in this process: {_describe()}")
        try:
            _load_pyav()
        except (RuntimeError, OSError) as err:
            raise RuntimeError(f"{FFMPEG_ENV}=pyav: PyAV's bundled FFmpeg cannot serve SPDL: "
                               f"{load_errors(err)}") from None
    try:
        return _describe()
    except _OtherBuild:
        raise
    except (RuntimeError, OSError) as err:
        if choice or _loaded:
            raise RuntimeError(f"{_NONE}: {load_errors(err)}") from None
        system = load_errors(err)
    try:
        _load_pyav()
        return _describe()
    except (RuntimeError, OSError) as err:
        raise RuntimeError(f"{_NONE} with the system's libraries: {system}; PyAV's bundled FFmpeg "
                           f"cannot serve either: {load_errors(err)}") from None


def load_errors(err: BaseException) -> str:
    """SPDL's "Failed to import libspdl. "build: reason", ..." as "build: reason; ...", each
    reason once; any other error as its first line."""
    found = re.findall(r'"spdl\.io\.lib\.(\w+): ([^"]+)"', str(err))
    if not found:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    reasons: dict[str, list[str]] = {}
    for build, reason in found:
        reasons.setdefault(reason, []).append(build)
    return "; ".join(f"{', '.join(builds)}: {reason}" for reason, builds in reasons.items())


def _describe() -> str:
    """Whose FFmpeg SPDL's build decodes with (:func:`load_ffmpeg`), the build imported first."""
    import spdl.io.utils

    versions = spdl.io.utils.get_ffmpeg_versions()  # imports SPDL's newest loadable build
    build = _loaded_build()
    codec = ".".join(map(str, versions["libavcodec"]))
    major = build[len("_spdl_ffmpeg"):] if build else "?"
    if _loaded and build != _loaded["build"]:
        raise _OtherBuild(f"PyAV's FFmpeg was loaded for SPDL's {_loaded['build']}, but SPDL "
                           f"took its newer {build} with the system's FFmpeg {major} "
                           f"(libavcodec {codec}); unset {FFMPEG_ENV} to use it")
    whose = "PyAV's bundled" if _loaded else "the system's"
    return f"{whose} FFmpeg {major} (libavcodec {codec})"


def _loaded_build() -> str | None:
    """The SPDL FFmpeg extension imported in this process (``_spdl_ffmpeg8``), if any."""
    found = [name for name, module in sys.modules.items()
             if name.startswith("spdl.io.lib._spdl_ffmpeg") and module is not None]
    return found[0].rsplit(".", 1)[1] if found else None


def _load_pyav() -> None:
    """PyAV's FFmpeg and the SPDL build for it, loaded (module docstring, steps 1 to 3)."""
    bundled = _pyav_libraries()
    build = _build_for({lib: major for lib, (_, major) in bundled.items()})
    for lib in _LIBS:
        if lib in bundled:
            _handles.append(ctypes.CDLL(str(bundled[lib][0])))
    _load_linked(build, {f"lib{lib}.so.{major}": path for lib, (path, major) in bundled.items()})
    _loaded["build"] = "_" + build.name[len("lib"):-len(".so")]  # libspdl_ffmpeg8.so: _spdl_ffmpeg8


def _load_linked(lib: Path, links: dict[str, Path]) -> None:
    """``lib`` loaded through a link in a temporary folder that also holds ``links`` (a name
    ``lib`` needs: the file to give it), so that its run path (``$ORIGIN``) finds them."""
    with tempfile.TemporaryDirectory(prefix="mmproxy-spdl-") as folder:
        link = Path(folder) / lib.name
        link.symlink_to(lib)
        for name, path in links.items():
            (Path(folder) / name).symlink_to(path)
        try:
            _handles.append(ctypes.CDLL(str(link)))
        except OSError as err:
            given = "".join(f", {name} linked to {path}" for name, path in links.items())
            raise RuntimeError(f"{lib} does not load{given}: {err}") from None


def load_cuda_build() -> None:
    """SPDL's CUDA build (``_spdl_cudaN``, for the FFmpeg build loaded) imported. Where it does
    not import as it is, two of the libraries it needs are given to it under the names it asks
    for, as PyAV's FFmpeg is (module docstring): ``libnvcuvid.so`` (the driver ships
    ``libnvcuvid.so.1``) and ``libcudart.so.13`` (a pip-installed CUDA runtime lies outside the
    linker's path).

    Raises:
        RuntimeError: it does not load either way (both reasons).
    """
    from spdl.io.lib import _libspdl_cuda

    try:
        _libspdl_cuda.built_with_nvjpeg()
        return
    except (RuntimeError, OSError) as err:
        first = load_errors(err)
    build = _loaded_build()
    if build is None:
        raise RuntimeError(f"{first} (no FFmpeg build of SPDL loaded)")
    import spdl.io.lib

    lib = Path(spdl.io.lib.__file__).parent / f"lib{build[1:].replace('ffmpeg', 'cuda')}.so"
    links = {name: path for name, path in (("libnvcuvid.so", _nvcuvid()),
                                           ("libcudart.so.13", _pip_cudart())) if path}
    try:
        _load_linked(lib, links)
        _libspdl_cuda.built_with_nvjpeg()
    except (RuntimeError, OSError) as err:
        raise RuntimeError(f"{first}; {load_errors(err)}") from None


def _nvcuvid() -> Path | None:
    """The driver's ``libnvcuvid.so.1``, where the linker has no ``libnvcuvid.so``."""
    if _loads("libnvcuvid.so") or not _loads("libnvcuvid.so.1"):
        return None
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libnvcuvid.so.1" in line}
    return Path(min(paths)) if paths else None


def _loads(name: str) -> bool:
    """Whether the linker finds and loads ``name`` (it stays loaded)."""
    try:
        _handles.append(ctypes.CDLL(name))
    except OSError:
        return False
    return True


def _pip_cudart() -> Path | None:
    """A pip-installed ``libcudart.so.13`` (``nvidia/...``), where the linker has none."""
    if _loads("libcudart.so.13"):
        return None
    import site

    for root in site.getsitepackages():
        for path in sorted(Path(root).glob("nvidia/**/libcudart.so.13*")):
            return path
    return None


def _pyav_libraries() -> dict[str, tuple[Path, int]]:
    """PyAV's bundled FFmpeg libraries, each one's path and major, from the files its wheel
    installed."""
    import importlib.metadata

    try:
        files = importlib.metadata.files("av") or []
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("PyAV is not installed (pip install av)") from None
    found: dict[str, tuple[Path, int]] = {}
    for file in files:
        match = _BUNDLED.match(file.name)
        if match:
            found[match[1]] = (Path(str(file.locate())).resolve(), int(match[2]))
    if "avutil" not in found:
        raise RuntimeError("this PyAV bundles no FFmpeg (it was built against the system's, which "
                           "SPDL would have found)")
    return found


def _build_for(majors: dict[str, int]) -> Path:
    """SPDL's build (``libspdl_ffmpegN.so``) that needs exactly PyAV's FFmpeg majors."""
    import spdl.io.lib

    where = Path(spdl.io.lib.__file__).parent
    for build in sorted(where.glob("libspdl_ffmpeg*.so"), reverse=True):
        needs = _needed_ffmpeg(build.read_bytes())
        if needs and all(majors.get(lib) == major for lib, major in needs.items()):
            return build
    pyav = ", ".join(f"lib{lib} {major}" for lib, major in sorted(majors.items()))
    raise RuntimeError(f"no SPDL build in {where} is built for PyAV's FFmpeg ({pyav})")


def _needed_ffmpeg(elf: bytes) -> dict[str, int]:
    """The FFmpeg libraries a shared object's dynamic string table names (``libavutil.so.60``),
    each one's major."""
    names = re.findall(rb"(?<=\0)lib(" + "|".join(_LIBS).encode() + rb")\.so\.(\d+)(?=\0)", elf)
    return {lib.decode(): int(major) for lib, major in names}
