#!/bin/bash
# integration/sglang_e2e.py on the project's H200 machine, which has no network and no sglang: installs the
# carried wheels (.e2ewhl: sglang 0.5.12 and the packages the image lacks, plus the kvcanary wheel) into
# /tmp/site, keeps every JIT cache under /tmp, runs the driver and leaves its folder as a tarball in $OUT.
# A user with sglang 0.5.12 installed runs the driver directly (integration/README.md); nothing here is needed.
#
#   bash integration/h200_e2e.sh TAG [driver args ...]      e.g. bash integration/h200_e2e.sh a --phases 1,2
#
# Called again on a still-warm machine it reuses /tmp/site and the JIT caches (only kvcanary is reinstalled).
set -u
TAG=${1:?usage: h200_e2e.sh TAG [driver args]}; shift
OUT=${OUT:-/tmp/e2e-out}; mkdir -p "$OUT"
SITE=${SITE_DIR:-/tmp/site}  # SITE_DIR: a second run beside the first gets its own copy
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE"
if [ ! -d $SITE/sglang ]; then
  $PIP .e2ewhl/*.whl >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
else
  rm -rf $SITE/kvcanary $SITE/kvcanary-*.dist-info
  $PIP .e2ewhl/kvcanary-*.whl >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
fi
# sgl_kernel's sm90 ops need libnuma.so.1; the image may lack it (a copy travels in .e2ewhl/lib)
ldconfig -p | grep -q 'libnuma.so.1 ' || export LD_LIBRARY_PATH=$PWD/.e2ewhl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# JIT caches under /tmp; CACHE_TAG gives a run its own set, so two runs on two GPUs of one machine never build
# into the same folder at once (e.g. CUDA_VISIBLE_DEVICES=1 CACHE_TAG=b bash integration/h200_e2e.sh ...).
C=/tmp/${CACHE_TAG:+$CACHE_TAG-}
export PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
  KVCANARY_CUDA_ARCH=${KVCANARY_CUDA_ARCH:-9.0a} KVCANARY_CACHE_DIR=${C}kvc TVM_FFI_CACHE_DIR=${C}tvmffi-cache \
  TRITON_CACHE_DIR=${C}triton-cache FLASHINFER_WORKSPACE_BASE=${C}fi-ws CUDA_CACHE_PATH=${C}nv-cache \
  TORCHINDUCTOR_CACHE_DIR=${C}torchinductor
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
# A carried prebuilt kernel cache (.kvc: built where nvcc is, e.g. `KVCANARY_CACHE_DIR=$PWD/.kvc
# KVCANARY_CUDA_ARCH=9.0a python -c "from kvcanary.kernels import jit; jit.build('cuda')"`) seeds this run's cache; its
# folder names carry the sources' digest and the arch, so a stale one is simply not used.
[ -d .kvc ] && mkdir -p "$KVCANARY_CACHE_DIR" && cp -an .kvc/. "$KVCANARY_CACHE_DIR"/
# Build kvcanary's CUDA module before any Engine starts: on a fresh machine the build takes 50-100 s, which would
# otherwise be spent inside the first phase's timeout (2026-11-30: phases cut before serving a request).
python3 -c "import time; from kvcanary.kernels import jit; t = time.time(); i = jit.build('cuda'); print(f'kvcanary cuda build: {time.time() - t:.1f} s (cached={i.cached})')" || exit 1
python3 integration/sglang_e2e.py --model .e2e/tiny-llama --out /tmp/e2e-$TAG "$@"
rc=$?
cp /tmp/e2e-$TAG/summary.md "$OUT/summary-$TAG.md" 2>/dev/null
tar czf "$OUT/e2e-$TAG.tgz" -C /tmp "e2e-$TAG"
exit $rc
