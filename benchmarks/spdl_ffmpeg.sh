#!/usr/bin/env bash
# SPDL's FFmpeg from an installed PyAV, for machines without FFmpeg's libraries (and no network).
#
# SPDL (spdl-io) ships one build per FFmpeg major and loads the first whose libraries the dynamic
# linker finds under their plain names (libavcodec.so.62, ...). PyAV's wheel bundles FFmpeg under
# av.libs/ with hashed names (libavcodec-5e6b81c2.so.62.28.102) that nothing else looks for. This
# script makes FOLDER (default ~/.cache/mmproxy/spdl-ffmpeg) with a link to every library of
# av.libs/ under its own name (their links to each other) and one under the plain name for
# FFmpeg's seven; where SPDL's CUDA build would miss libnvcuvid.so or libcudart.so.13 and only a
# versioned or pip-installed copy exists, links to those too. It checks that SPDL then loads
# FFmpeg from there and prints the line to run (stdout; the rest goes to stderr):
#
#   eval "$(benchmarks/spdl_ffmpeg.sh)"      # then: mmproxy bench --systems spdl,...
#
# The loader reads LD_LIBRARY_PATH when a process starts, so it must be set before Python starts.
# PYTHON names the interpreter whose PyAV and SPDL to use (default: python).
set -euo pipefail

python=${PYTHON:-python}
folder=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/mmproxy/spdl-ffmpeg}

libs=$("$python" - <<'EOF'
import pathlib, sys
try:
    import av
except ImportError as err:
    sys.exit(f"spdl_ffmpeg.sh: PyAV is not installed ({err}); pip install av")
where = pathlib.Path(av.__file__).resolve().parent.parent / "av.libs"
if not where.is_dir():
    sys.exit(f"spdl_ffmpeg.sh: PyAV {av.__version__} has no {where} (a build that uses the "
             "system's FFmpeg: SPDL can use that one directly)")
print(where)
EOF
)

mkdir -p "$folder"
find "$folder" -maxdepth 1 -type l -delete  # links of an earlier PyAV
plain=0 avcodec=
for lib in "$libs"/*.so*; do
  name=$(basename "$lib")
  ln -s "$lib" "$folder/$name"
  # libavcodec-5e6b81c2.so.62.28.102 -> libavcodec.so.62 (FFmpeg's libraries only)
  if [[ $name =~ ^lib(avcodec|avformat|avfilter|avdevice|avutil|swresample|swscale)-[0-9a-f]+\.so\.([0-9]+) ]]; then
    ln -s "$lib" "$folder/lib${BASH_REMATCH[1]}.so.${BASH_REMATCH[2]}"
    plain=$((plain + 1))
    [[ ${BASH_REMATCH[1]} == avcodec ]] && avcodec=${BASH_REMATCH[2]}
  fi
done
if [[ $plain -lt 5 ]]; then
  echo "spdl_ffmpeg.sh: found $plain of FFmpeg's libraries in $libs (SPDL needs avcodec, avformat," \
       "avfilter, avdevice and avutil)" >&2
  exit 1
fi

# SPDL's CUDA build (spdl-gpu) links libnvcuvid.so (the driver ships libnvcuvid.so.1) and
# libcudart.so.13 (a pip-installed CUDA runtime is not on the loader's path).
if ! ldconfig -p | grep -q 'libnvcuvid\.so '; then
  nvcuvid=$(ldconfig -p | awk '/libnvcuvid\.so\.1 /{print $NF; exit}')
  [[ -n $nvcuvid ]] && ln -s "$nvcuvid" "$folder/libnvcuvid.so"
fi
if ! ldconfig -p | grep -q 'libcudart\.so\.13 '; then
  cudart=$("$python" - <<'EOF'
import pathlib, site
for root in site.getsitepackages():
    for path in sorted(pathlib.Path(root).glob("nvidia/**/libcudart.so.13*")):
        print(path)
        raise SystemExit
EOF
)
  [[ -n $cudart ]] && ln -s "$cudart" "$folder/libcudart.so.13"
fi

export LD_LIBRARY_PATH="$folder${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$python" - "$folder" "$avcodec" <<'EOF' >&2
import sys
try:
    import spdl.io.utils
except ImportError as err:
    sys.exit(f"spdl_ffmpeg.sh: SPDL is not installed ({err}); pip install 'mmproxy[spdl]'")
try:
    versions = spdl.io.utils.get_ffmpeg_versions()
except RuntimeError as err:
    sys.exit(f"spdl_ffmpeg.sh: SPDL still loads no FFmpeg build with {sys.argv[1]}: {err}")
found = ".".join(map(str, versions["libavcodec"]))
if str(versions["libavcodec"][0]) != sys.argv[2]:
    sys.exit(f"spdl_ffmpeg.sh: SPDL loads another FFmpeg (libavcodec {found}) before PyAV's "
             f"(libavcodec {sys.argv[2]}); no SPDL build matches PyAV's")
print(f"spdl_ffmpeg.sh: SPDL loads PyAV's FFmpeg (libavcodec {found}) from {sys.argv[1]}")
EOF
echo "export LD_LIBRARY_PATH=$folder\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
