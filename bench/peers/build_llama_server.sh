#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` from source for `everybyte bench compare --peers llamaserver`.
#
# The sources come from PyPI: the llama-cpp-python sdist vendors llama.cpp under vendor/llama.cpp
# (llama-cpp-python 0.3.36 carries ggml-org/llama.cpp@0c1e57098). The result is one binary with
# llama/ggml linked in statically (BUILD_SHARED_LIBS=OFF; only system libs such as libgomp and
# libstdc++ stay dynamic) at ${EVERYBYTE_HOME:-~/.cache/everybyte}/llama.cpp/bin/, with a VERSION
# file next to it. 17 minutes on a 2-core host shared with other jobs.
#
#   bash bench/peers/build_llama_server.sh            # default: llama-cpp-python==0.3.36
#   LLAMA_CPP_PYTHON_VERSION=0.3.35 JOBS=4 bash bench/peers/build_llama_server.sh
#
# Offline-friendly flags beyond the usual ones: LLAMA_USE_PREBUILT_UI=OFF (no web-UI download from
# Hugging Face at build time; the server runs with --no-webui anyway) and LLAMA_OPENSSL=OFF (the
# server only listens on plain HTTP here; keeps the binary free of libssl).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
HOME_DIR="${EVERYBYTE_HOME:-$HOME/.cache/everybyte}"
DEST="$HOME_DIR/llama.cpp/bin"
WORK="${LLAMA_BUILD_DIR:-$HOME_DIR/llama.cpp/src}"

mkdir -p "$WORK" "$DEST"
cd "$WORK"
SDIST="llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
fi
rm -rf "llama_cpp_python-$VERSION"
tar xzf "$SDIST"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cd "$SRC"
# The sdist keeps a shallow git module, so build-info (and `llama-server --version`) gets the commit.
COMMIT="$(git rev-parse --short=9 HEAD 2>/dev/null || echo unknown)"

# -march=native on a CPU with AMX compiles ggml's AMX matmul, which crashes (SIGSEGV in
# ggml_backend_amx_mul_mat, seen on a Sapphire Rapids VM whose kernel does not grant AMX tile state).
# There: the same ISA as native, named flag by flag, without AMX.
ISA="-DGGML_NATIVE=ON"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    for f in avx512f:AVX512 avx512_vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        grep -qw "${f%%:*}" /proc/cpuinfo && ISA="$ISA -DGGML_${f##*:}=ON"
    done
fi
FLAGS="$ISA -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"
# shellcheck disable=SC2086
cmake -B build $FLAGS
cmake --build build --target llama-server -j"$JOBS"

install -m 0755 build/bin/llama-server "$DEST/llama-server"
{
    echo "llama-cpp-python sdist: $VERSION"
    echo "llama.cpp commit: $COMMIT"
    echo "cmake flags: $FLAGS"
    "$DEST/llama-server" --version 2>&1 | head -n 3
} > "$DEST/VERSION"
cat "$DEST/VERSION"
echo "installed: $DEST/llama-server"
