#!/usr/bin/env bash
# Build .devbundle/verl/chunks/{vsgl,vfidata,vpy}: verl 0.9.1 and the SGLang it pins, for
# benchmarks/e2e_vs_verl.py on the GPU machine, in the format of ../shared/device/build.sh's chunks (a
# `pip install --no-deps --target` tree, stripped, tar + xz, split in parts, sha256 MANIFEST). They live under
# .devbundle/verl, NOT .devbundle/chunks: they are installed into a site directory of their own
# (/tmp/site-verl, by scripts/gpu/e2e_vs_verl.sh), so verl's stack (sglang 0.5.12, transformers 5.9.0) never
# shares a process with megarl's (/tmp/site: sglang 0.5.17, transformers 5.12.1). Both use the machine's
# torch 2.11.0+cu130. Benchmark-only: nothing in megarl imports them. Runs HERE (the package index), from
# the checkout root:
#
#   bash scripts/gpu/build_verl_chunk.sh       # -> .devbundle/verl/chunks (sizes: docs/benchmarks.md); FORCE=1
#
# What goes in (CPython 3.12, manylinux x86_64), read off the wheels' Requires-Dist and checked against the
# GPU image's package list (KINDS.md: torch, torchvision, torchaudio, numpy, pandas, peft, accelerate,
# tensorboard, pybind11, psutil, prometheus-client, scipy, sentencepiece, tiktoken, einops, pillow, uvloop,
# nvidia-ml-py, cloudpickle, huggingface-hub, safetensors, ... are there):
#   vsgl     sglang 0.5.12 + sglang-kernel 0.4.2.post2 (the pair verl[sglang] pins) with the runtime packages of
#            the bundle's core chunk at the versions sglang 0.5.12 pins (flashinfer-python 0.6.11.post1,
#            apache-tvm-ffi 0.1.9, xgrammar 0.2.0, openai 2.6.1, torchao 0.17.0). Stripped as core is: FA3
#            flash_ops (1.07 GB), FlashMLA, InfLLM, sm100 build, mscclpp static libs, diffusion stack, tests,
#            Rust/gRPC extensions, xgrammar's static lib. So SGLang runs with --attention-backend triton here
#            too (the e2e script sets it on both sides: the same attention kernels in both rollouts).
#   vfidata  flashinfer/data of 0.6.11.post1 (JIT sources; sgl_kernel's rmsnorm builds from them on first use)
#   vpy      verl 0.9.1, transformers 5.9.0 + tokenizers 0.22.2, transferqueue 0.1.11 (verl's v1 trainer imports
#            it), hydra-core 1.3.8 + omegaconf 2.3.0 + antlr4-python3-runtime 4.9.3 (sdist only: built here into a
#            pure-Python wheel), tensordict 0.10.0 + pyvers, torchdata 0.11.0, codetiming, cachetools,
#            pylatexenc, importlib-metadata, datasets 5.2.0 + multiprocess + pyarrow 26.0.1 (stripped as in
#            build_trl_chunk.sh), orjson.
#   ray      not built here: verl uses the bundle's ray 2.60.0 chunk (ray >= 2.41 is all verl asks);
#            e2e_vs_verl.sh installs those parts from /tmp/bundle_parts into /tmp/site-verl too.
# Known mismatches, on purpose:
#   - sglang 0.5.12 pins transformers==5.6.0, verl[sglang] pins 5.9.0: pip's resolver refuses the pair; we
#     take verl's 5.9.0 (verl's own recipe for this extra), installed --no-deps.
#   - flash-attn 2.8.3 (verl[fsdp]'s pin) is on the index as a source distribution only (a CUDA build of
#     ~1 h, not possible offline on the GPU machine): left out, so verl runs with
#     actor_rollout_ref.model.use_remove_padding=False (padded rows in its actor), and the results say so.
#   - wandb, mathruler, qwen_vl_utils, torchcodec, nvtx, liger-kernel, flashinfer-cubin, sglang's optional
#     kernels (flash-attn-4, quack-kernels, tilelang, sgl-deep-gemm, tokenspeed_mla) are left out: nothing on
#     this text-only, FSDP + SGLang(triton) path imports them at module level (checked by grep of the wheels).
# Env: BUNDLE (default $PWD/.devbundle), DEVBUNDLE_CACHE (wheel cache + pip venv; build.sh's is reused),
#      PY312 (a CPython 3.12 if no cached venv), FORCE, PART_SIZE (default 20m: parts are spread over calls, docs/benchmarks.md).
set -euo pipefail
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
BUNDLE="${BUNDLE:-$PWD/.devbundle}"
CACHE="${DEVBUNDLE_CACHE:-$BUNDLE/cache}"
WHEELS="$CACHE/wheels"
OUT="$BUNDLE/verl/chunks"
STAGE="$BUNDLE/.stage-verl"
PART_SIZE="${PART_SIZE:-20m}"
T_START=$(date +%s)
# >>> recipe (part of the stamp)
VSGL=(
  sglang==0.5.12 sglang-kernel==0.4.2.post2 flashinfer-python==0.6.11.post1 apache-tvm-ffi==0.1.9
  xgrammar==0.2.0 openai==2.6.1 torchao==0.17.0 torch_memory_saver==0.0.10 torch_c_dlpack_ext==0.1.5
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 opentelemetry-api==1.45.2 uvicorn==0.54.0 python-multipart==0.0.34
  pyzmq==27.3.0 orjson==3.13.0 pybase64==1.5.1 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7
  msgspec==0.22.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 compressed-tensors==0.20.0 loguru==0.7.3
  gguf==0.19.0 zstandard==0.25.0 dill==0.4.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 ipython==9.18.1
  traitlets==5.16.1
)
VPY=(
  verl==0.9.1 transformers==5.9.0 tokenizers==0.22.2 transferqueue==0.1.11 hydra-core==1.3.8 omegaconf==2.3.0
  antlr4-python3-runtime==4.9.3 tensordict==0.10.0 pyvers==0.1.0 torchdata==0.11.0 codetiming==1.4.0
  cachetools==8.0.1 pylatexenc==2.11 importlib-metadata==8.7.0 datasets==5.2.0 multiprocess==0.70.19
  pyarrow==26.0.1
)
# <<< recipe
mkdir -p "$WHEELS" "$OUT"
if git rev-parse --show-toplevel >/dev/null 2>&1; then   # keep the bundle out of git, as build.sh does
  excl="$(git rev-parse --path-format=absolute --git-path info/exclude)"
  case "$(cd "$BUNDLE" && pwd -P)/" in "$(git rev-parse --show-toplevel)"/*)
    grep -qxF "/.devbundle/" "$excl" 2>/dev/null || echo "/.devbundle/" >> "$excl" ;; esac
fi
STAMP="$(sed -n '/^# >>> recipe/,/^# <<< strip/p' "$SELF" | sha256sum | cut -c1-16)"
built() { [ "${FORCE:-0}" != 1 ] && [ -f "$OUT/$1/MANIFEST" ] && [ "$(cat "$OUT/$1/.stamp" 2>/dev/null)" = "$STAMP" ]; }
if built vsgl && built vfidata && built vpy; then echo "== verl chunks: up to date"; du -sh "$OUT"/*/; exit 0; fi

# ---- pip for a 3.12 target: build.sh's cached venv, else a new one from a CPython 3.12
is312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
VENV="$CACHE/pipvenv"
if ! is312 "$VENV/bin/python"; then
  PY=""
  for c in "${PY312:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && is312 "$c" && { PY="$c"; break; }; done
  [ -n "$PY" ] || { echo "build_verl_chunk.sh: no CPython 3.12; set PY312=/path/to/python3.12" >&2; exit 1; }
  rm -rf "$VENV"; "$PY" -m venv "$VENV"; "$VENV/bin/python" -m pip install -q -U pip
fi
pip_() { "$VENV/bin/python" -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
PLAT=()
for n in 39 35 34 31 28 27 26 24 18 17; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
whl() { # the cached wheel of "name==ver" (names normalised as in wheel file names), or nothing
  local n="${1%%==*}" v="${1#*==}" f b; n="${n//-/_}"; n="${n//./_}"
  for f in "$WHEELS"/*.whl; do b="${f##*/}"; [[ "${b,,}" == "${n,,}-${v,,}-"* ]] && { echo "$f"; return 0; }; done; return 0; }

echo "== download (cache: $WHEELS)"
for spec in "${VSGL[@]}" "${VPY[@]}"; do
  [ -n "$(whl "$spec")" ] && continue
  pip_ download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$WHEELS" "$spec"
  if [ -z "$(whl "$spec")" ]; then  # a source distribution only: build it here, if it is pure Python
    pip_ wheel -q --no-deps -w "$WHEELS" "$spec"
    case "$(whl "$spec")" in *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
      "") echo "build_verl_chunk.sh: no wheel for $spec" >&2; exit 1 ;;
      *) echo "build_verl_chunk.sh: $spec built a platform wheel here; not portable" >&2; exit 1 ;; esac
  fi
done

stage() { local dst="$1"; shift; local files=() s; for s in "$@"; do files+=("$(whl "$s")"); done
  rm -rf "$dst"; mkdir -p "$dst"; pip_ install -q --no-deps --no-index --no-compile --target "$dst" "${files[@]}"; }
pack() { local name="$1" src="$2" t=$(date +%s); built "$name" && { echo "   $name: up to date"; return 0; }
  rm -rf "${OUT:?}/$name"; mkdir -p "$OUT/$name"
  tar -C "$src" -cf - . | xz -T0 -6 | split -b "$PART_SIZE" -d - "$OUT/$name/$name.tar.xz.part"
  (cd "$OUT/$name" && sha256sum "$name".tar.xz.part* > MANIFEST)
  echo "$STAMP" > "$OUT/$name/.stamp"   # last: a chunk cut off while packing is packed again
  echo "   $name: $(du -sh "$src" | cut -f1) unpacked -> $(du -sh "$OUT/$name" | cut -f1) in $(( $(date +%s)-t )) s"; }

echo "== stage + strip"
S="$STAGE/vsgl"; F="$STAGE/vfidata"; P="$STAGE/vpy"
mkdir -p "$S" "$F/flashinfer" "$P"  # (staged only for the chunks not up to date: a rerun after a cut-off build)
{ built vsgl && built vfidata; } || stage "$S" "${VSGL[@]}"
built vpy || stage "$P" "${VPY[@]}"
# >>> strip (part of the stamp)
rm -rf "$S"/sgl_kernel/flash_ops.abi3.so "$S"/sgl_kernel/flashmla_ops.abi3.so "$S"/sgl_kernel/infllm_ops*.so \
       "$S"/sgl_kernel/sm100 "$S"/lib/*.a         # FA3, FlashMLA, InfLLM, Blackwell, static libs; H100/H200: sm90/
rm -rf "$S"/sglang/multimodal_gen "$S"/sglang/test \
       "$S"/sglang/srt/server/_core.*.so "$S"/sglang/srt/grpc/_core.*.so "$S"/sglang/srt/multimodal/_core.*.so
rm -rf "$S"/xgrammar/lib "$S"/xgrammar/include
rm -f  "$S"/torch_memory_saver_*cu12*.so
[ -d "$S"/flashinfer/data ] && { rm -rf "$F"; mkdir -p "$F/flashinfer"; mv "$S"/flashinfer/data "$F/flashinfer/data"; }
A="$P/pyarrow"
rm -rf "$A"/include "$A"/src "$A"/tests "$A"/_pyarrow_cpp_tests.* "$A"/libarrow_flight.so* \
       "$A"/libarrow_python_flight.so* "$A"/_flight.*.so "$A"/libarrow_s3.so* "$A"/_s3fs.*.so
[ -d "$A" ] && find "$A" \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' -o -name '*.h' -o -name '*.cc' \) -delete
rm -rf "$S"/bin "$P"/bin
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
# <<< strip

echo "== pack"
pack vsgl "$S"; pack vfidata "$F"; pack vpy "$P"
rm -rf "$STAGE"
echo "== verl chunks in $OUT (built in $(( $(date +%s)-T_START )) s)"
(cd "$OUT" && find . -type f ! -name .stamp -printf '%10s  %p\n' | sort -k2)
