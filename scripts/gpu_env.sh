# Sourced by the GPU scripts (gpu_check.sh, gpu_mesh_check.sh) on the GPU machine: sets BIN and OUT, links
# optimusc where the run tests look for it, and puts the CUDA libraries of the machine's Python wheels
# (PyTorch's) on the library path for the test binaries, which load NVRTC, cuBLAS and NCCL as cudarc finds
# them (optimusc itself finds them as docs/clusters.md says). NCCL's wheel ships only `libnccl.so.2`,
# a name cudarc does not open: a private folder links `libnccl.so` to it.
BIN="${BIN:-.gpu}"
OUT="${OUT:-/tmp/optimus-gpu-check}"
mkdir -p "$OUT"
built_at=$(cat "$BIN/optimusc_path")
if [ ! -x "$built_at" ]; then
    mkdir -p "$(dirname "$built_at")" && ln -sf "$PWD/$BIN/optimusc" "$built_at"
fi
wheels=$(python3 -c 'import glob, os, sys
print(":".join(sorted({os.path.dirname(p) for sp in sys.path if os.path.isdir(sp)
                        for p in glob.glob(os.path.join(sp, "nvidia", "*", "lib", "lib*.so*"))})))' 2>/dev/null)
nccl_links=$(mktemp -d)
for folder in ${wheels//:/ }; do
    [ -e "$folder/libnccl.so.2" ] && ln -sf "$folder/libnccl.so.2" "$nccl_links/libnccl.so"
done
export LD_LIBRARY_PATH="${nccl_links}:${wheels}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OPTIMUS_REQUIRE_CUDA=1 OPTIMUS_REQUIRE_FLASH=1 OPTIMUS_REQUIRE_NVRTC=1
status=0
# run_step NAME LIMIT COMMAND...: runs a step into $OUT/NAME.log, notes its exit status and time in
# summary, and prints the log's tail; SKIP="name ..." leaves steps out.
summary=()
run_step() {  # name, timeout (s), command...; SKIP="name ..." leaves steps out
    local name=$1 limit=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) summary+=("$name: skipped"); return 0 ;; esac
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || status=1
    summary+=("$name: rc $rc in $((SECONDS - start)) s")
    tail -n "${TAIL_LINES:-8}" "$OUT/$name.log"
}

