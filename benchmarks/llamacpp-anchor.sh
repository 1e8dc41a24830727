#!/bin/bash
# The peer every benchmark measures against: llama.cpp, built from the llama.cpp tree that the
# llama-cpp-python source archive on the package index vendors, and named exactly in every record
# (the archive's sha256, the package version, the llama.cpp commit the archive's own git metadata
# pins for vendor/llama.cpp).
#   here (the development side, once):
#       bash benchmarks/llamacpp-anchor.sh prepare [SDIST]
#     -> .anchor/llama.tar.xz (the vendored tree, ~8 MB), .anchor/llama-source.json (what it is),
#        .anchor/llamacpp-anchor.sh (this script, for the GPU side). SDIST: a source archive already
#        downloaded (llama_cpp_python-<version>.tar.gz), else pip downloads $LLAMA_CPP_PYTHON's.
#   on the GPU machine, carry [".anchor"]:
#       bash .anchor/llamacpp-anchor.sh build            (about 5 minutes; `build --cpu`: a CPU build)
#     -> .anchor/llama.cpp/build/bin/llama-bench, whose --version names the vendored commit, and
#        .anchor/llama.cpp/llama-source.json, the description of the tree it was built from, which
#        the benchmarks copy into each llama.cpp arm (benchmarks/llama_runs.py llama_source).
#   `unpack` alone: the tree and its description, no build.
# Build and bench in the same call, or the machine may be given back between calls and the build is lost.
set -euo pipefail
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
here=$(cd "$(dirname "$0")" && pwd)

unpack() {   # the tree and its description, from the archive beside this script (once)
  cd "$here"
  if [ ! -d llama.cpp ]; then
    [ -f llama-source.json ] || { echo "error: $here/llama-source.json missing: run prepare first" >&2; exit 2; }
    tar xJf llama.tar.xz
    # the description travels with the tree it describes: a tree unpacked from another archive
    # has none, and the benchmarks refuse to name it
    cp llama-source.json llama.cpp/llama-source.json
  fi
}

case "${1:-}" in
prepare)
  root=$(git rev-parse --show-toplevel); cd "$root"
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '/.anchor/' "$exclude" 2>/dev/null || echo '/.anchor/' >> "$exclude"
  mkdir -p .anchor && tmp=$(mktemp -d)
  if [ -n "${2:-}" ]; then
    sdist=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
  else
    python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp"
    sdist=$(ls "$tmp"/llama_cpp_python-*.tar.gz)
  fi
  tar xzf "$sdist" -C "$tmp"
  pkg=$(ls -d "$tmp"/llama_cpp_python-*/ | head -1); pkg=${pkg%/}
  tar cJf .anchor/llama.tar.xz -C "$pkg/vendor" \
    --exclude='llama.cpp/models' --exclude='llama.cpp/docs' --exclude='llama.cpp/benches' \
    --exclude='llama.cpp/ggml/src/ggml-vulkan' --exclude='llama.cpp/ggml/src/ggml-sycl' --exclude='llama.cpp/ggml/src/ggml-metal' \
    --exclude='llama.cpp/ggml/src/ggml-cann' --exclude='llama.cpp/ggml/src/ggml-opencl' --exclude='llama.cpp/ggml/src/ggml-musa' \
    --exclude='llama.cpp/ggml/src/ggml-webgpu' --exclude='llama.cpp/tools/server/webui' llama.cpp
  # the source archive carries its own git metadata: its HEAD's gitlink for vendor/llama.cpp is
  # the llama.cpp commit it vendors (the vendored tree has no .git of its own)
  commit=$(git --git-dir="$pkg/.git" ls-tree HEAD vendor/llama.cpp 2>/dev/null | awk '$2 == "commit" {print $3}')
  python3 - "$sdist" "$pkg" "$commit" .anchor/llama.tar.xz > .anchor/llama-source.json <<'EOF'
import hashlib, json, os, re, sys
sdist, pkg, commit, repacked = sys.argv[1:]
def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
with open(os.path.join(pkg, "PKG-INFO")) as f:
    meta = dict(re.findall(r"^(Name|Version): (.+)$", f.read(), re.M))
json.dump({"package": meta["Name"].replace("_", "-"), "package_version": meta["Version"],
           "archive": os.path.basename(sdist), "archive_sha256": sha256(sdist),
           "vendored": "vendor/llama.cpp", "vendored_commit": commit,
           "repacked": os.path.basename(repacked), "repacked_sha256": sha256(repacked)},
          sys.stdout, indent=1)
print()
EOF
  rm -rf .anchor/llama.cpp       # a tree unpacked from an earlier archive is not this one
  cp "$here/$(basename "$0")" .anchor/llamacpp-anchor.sh; rm -rf "$tmp"; cat .anchor/llama-source.json; ls -la .anchor ;;
unpack)
  unpack; echo "unpacked $here/llama.cpp" ;;
build)
  cuda=ON; [ "${2:-}" = --cpu ] && cuda=OFF
  unpack; cd "$here/llama.cpp"
  # the vendored tree has no .git, so llama.cpp's build would say "commit unknown": name the
  # commit the archive pins, so llama-bench --version says it too
  commit=$(python3 -c 'import json; print(json.load(open("llama-source.json"))["vendored_commit"][:7] or "unknown")')
  archs=(); [ "$cuda" = ON ] && archs=(-DCMAKE_CUDA_ARCHITECTURES=90)
  cmake -B build -DGGML_CUDA=$cuda "${archs[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_COMMIT="$commit" > build.log 2>&1
  cmake --build build -j "$(nproc)" --target llama-bench >> build.log 2>&1 && echo "built $PWD/build/bin/llama-bench" ;;
*) echo "usage: $0 prepare [SDIST] | unpack | build [--cpu]" >&2; exit 2 ;;
esac
