# Sourced by scripts/gpu_check.sh (and its CPU tests): put a carried libnccl.so.2 in place of the
# python's for a run, and back. The library comes in parts (scripts/fetch_gpu_nccl.sh: part-00 ...
# and libnccl.so.2.sha256 in one folder), is joined and checked against its sha256, and replaces
# site-packages/nvidia/nccl/lib/libnccl.so.2 (the one file torch and CuPy both map) by a rename, so
# a process that has the old one mapped keeps it; the original waits beside it, renamed, until
# nccl_restore puts it back (gpu_check.sh calls that at its end and from its traps; a check killed
# with SIGKILL leaves it there, and the next check restores it first).

NCCL_SAVED_SUFFIX=.gpu-check-saved

nccl_split() {  # library, parts folder, MiB per part (under 60): the parts and the library's sha256
    local lib=$1 dir=$2 mib=$3
    if [ "$mib" -ge 60 ]; then
        echo "parts of $mib MiB: each must stay under 60 MiB (the device tool takes 64 MiB per command)"
        return 2
    fi
    rm -rf "$dir" && mkdir -p "$dir" || return 1
    split -b "${mib}M" -d -a 2 "$lib" "$dir/part-" || return 1
    (cd "$(dirname "$lib")" && sha256sum "$(basename "$lib")") | awk '{print $1 "  libnccl.so.2"}' >"$dir/libnccl.so.2.sha256"
}

nccl_assemble() {  # parts folder, target file: join the parts, check the sha256; 0 when it matches
    local dir=$1 target=$2 want got
    if ! ls "$dir"/part-[0-9][0-9] >/dev/null 2>&1; then
        echo "no parts (part-00, part-01, ...) in $dir: run scripts/fetch_gpu_nccl.sh, and carry each part"
        return 1
    fi
    if [ ! -s "$dir/libnccl.so.2.sha256" ]; then
        echo "no $dir/libnccl.so.2.sha256 beside the parts"
        return 1
    fi
    cat "$dir"/part-[0-9][0-9] >"$target" || return 1
    want=$(awk '{print $1; exit}' "$dir/libnccl.so.2.sha256")
    got=$(sha256sum "$target" | awk '{print $1}')
    if [ "$want" != "$got" ]; then
        echo "sha256 of the joined parts is $got, not $want (a part missing or damaged: carry them again)"
        rm -f "$target"
        return 1
    fi
}

nccl_swap_in() {  # the python's libnccl.so.2 path, the checked library: the library takes its place
    local lib=$1 new=$2
    [ -e "$lib" ] || { echo "$lib does not exist"; return 1; }
    if [ ! -e "$lib$NCCL_SAVED_SUFFIX" ]; then
        mv "$lib" "$lib$NCCL_SAVED_SUFFIX" || return 1
    fi
    cp "$new" "$lib.gpu-check-new" && mv -f "$lib.gpu-check-new" "$lib"
}

nccl_restore() {  # the python's libnccl.so.2 path: the original back in place (nothing to do if it is)
    local lib=$1
    if [ -e "$lib$NCCL_SAVED_SUFFIX" ]; then
        mv -f "$lib$NCCL_SAVED_SUFFIX" "$lib"
    fi
}
