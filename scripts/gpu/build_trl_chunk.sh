#!/usr/bin/env bash
# Build .devbundle/chunks/trl: TRL and `datasets` for benchmarks/e2e_vs_trl.py on the GPU machine, in the
# format of ../shared/device/build.sh's chunks (a `pip install --no-deps --target` tree, stripped, tar + xz,
# split in parts, sha256 MANIFEST), so the bundle's install.sh unpacks it into /tmp/site like the others.
# Benchmark-only dependencies: nothing in megarl imports them. Runs HERE (PyPI), from the checkout root:
#
#   bash scripts/gpu/build_trl_chunk.sh       # -> .devbundle/chunks/trl (~25 MiB); FORCE=1 rebuilds
#
# What goes in (CPython 3.12, manylinux x86_64). `pip install --dry-run --report` of trl==1.16.0 +
# datasets==5.2.0 + transformers==5.12.1 resolves 66 distributions; the GPU image (KINDS.md's package
# list: accelerate 1.15, huggingface-hub 1.33, pandas, xxhash, fsspec, psutil, jinja2, pyyaml, tqdm, httpx,
# rich, ...) and the bundle's core chunk (transformers 5.12.1, tokenizers, dill 0.4.1, pydantic) hold all but:
#   trl 1.16.0          needs transformers >= 4.56.2, accelerate >= 1.10.1, datasets >= 4.7 (smoke-run on CPU
#                       with transformers 5.12.1, accelerate 1.15.0, datasets 5.2.0)
#   datasets 5.2.0      needs pyarrow >= 24, dill < 0.4.2, multiprocess < 0.70.20, huggingface-hub >= 1.31
#   multiprocess 0.70.19
#   pyarrow 26.0.1      the image has a pyarrow of unknown version; this one shadows it from /tmp/site (pandas
#                       takes any recent one). Stripped: Flight, S3, headers, Cython sources, C++ tests.
#                       PYARROW=0 leaves it out (chunk ~1 MiB) if the image's is >= 24.
# Env: BUNDLE (default $PWD/.devbundle), DEVBUNDLE_CACHE (wheel cache + pip venv; build.sh's is reused),
#      PY312 (a CPython 3.12 if no cached venv), PYARROW, FORCE, PART_SIZE.
set -euo pipefail
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
BUNDLE="${BUNDLE:-$PWD/.devbundle}"
CACHE="${DEVBUNDLE_CACHE:-$BUNDLE/cache}"
WHEELS="$CACHE/wheels"
OUTC="$BUNDLE/chunks/trl"
STAGE="$BUNDLE/.stage-trl"
PYARROW="${PYARROW:-1}"
PART_SIZE="${PART_SIZE:-60m}"
PKGS=(trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19)
[ "$PYARROW" = 1 ] && PKGS+=(pyarrow==26.0.1)
mkdir -p "$WHEELS" "$BUNDLE/chunks"
if git rev-parse --show-toplevel >/dev/null 2>&1; then   # keep the bundle out of git, as build.sh does
  excl="$(git rev-parse --path-format=absolute --git-path info/exclude)"
  case "$(cd "$BUNDLE" && pwd -P)/" in "$(git rev-parse --show-toplevel)"/*)
    grep -qxF "/.devbundle/" "$excl" 2>/dev/null || echo "/.devbundle/" >> "$excl" ;; esac
fi

STAMP="$( (sed -n '/^PKGS=/,/^# <<< strip/p' "$SELF"; echo "$PYARROW") | sha256sum | cut -c1-16)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$OUTC/MANIFEST" ] && [ "$(cat "$OUTC/.stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "== trl chunk: up to date ($(du -sh --exclude=.stamp "$OUTC" | cut -f1))"; exit 0; fi

# ---- pip for a 3.12 target: build.sh's cached venv, else a new one from a CPython 3.12
is312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
VENV="$CACHE/pipvenv"
if ! is312 "$VENV/bin/python"; then
  PY=""
  for c in "${PY312:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && is312 "$c" && { PY="$c"; break; }; done
  [ -n "$PY" ] || { echo "build_trl_chunk.sh: no CPython 3.12; set PY312=/path/to/python3.12" >&2; exit 1; }
  rm -rf "$VENV"; "$PY" -m venv "$VENV"; "$VENV/bin/python" -m pip install -q -U pip
fi
pip_() { "$VENV/bin/python" -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
PLAT=()
for n in 39 35 34 31 28 27 26 24 18 17; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)

echo "== download (cache: $WHEELS)"
files=()
for spec in "${PKGS[@]}"; do
  n="${spec%%==*}"; v="${spec#*==}"
  f="$(ls "$WHEELS"/"${n//-/_}"-"$v"-*.whl 2>/dev/null | head -1 || true)"
  if [ -z "$f" ]; then
    pip_ download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
      -d "$WHEELS" "$spec"
    f="$(ls "$WHEELS"/"${n//-/_}"-"$v"-*.whl 2>/dev/null | head -1 || true)"
  fi
  [ -n "$f" ] || { echo "build_trl_chunk.sh: no cp312 x86_64 wheel for $spec" >&2; exit 1; }
  files+=("$f")
done

echo "== stage + strip"
rm -rf "$STAGE"; mkdir -p "$STAGE"
pip_ install -q --no-deps --no-index --no-compile --target "$STAGE" "${files[@]}"
# >>> strip (part of the stamp)
rm -rf "$STAGE"/bin
A="$STAGE/pyarrow"
if [ -d "$A" ]; then  # nothing that datasets imports needs these (checked with readelf's NEEDED lists)
  rm -rf "$A"/include "$A"/src "$A"/tests "$A"/_pyarrow_cpp_tests.* \
         "$A"/libarrow_flight.so* "$A"/libarrow_python_flight.so* "$A"/_flight.*.so \
         "$A"/libarrow_s3.so* "$A"/_s3fs.*.so
  find "$A" \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' -o -name '*.h' -o -name '*.cc' \) -delete
fi
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
# <<< strip

echo "== pack"
rm -rf "$OUTC"; mkdir -p "$OUTC"
tar -C "$STAGE" -cf - . | xz -T0 -6 | split -b "$PART_SIZE" -d - "$OUTC/trl.tar.xz.part"
(cd "$OUTC" && sha256sum trl.tar.xz.part* > MANIFEST)
echo "$STAMP" > "$OUTC/.stamp"
echo "   trl: $(du -sh "$STAGE" | cut -f1) unpacked -> $(du -sh --exclude=.stamp "$OUTC" | cut -f1) ($(ls "$STAGE" | grep -v dist-info | tr '\n' ' '))"
rm -rf "$STAGE"
