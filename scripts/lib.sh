# Shared setup for scripts/serve and scripts/test (sourced, not run). Debian 12.
#
# ensure_packages: installs the apt packages below that are missing (no apt call at all when
#                  everything is present, so a prepared machine pays nothing).
# ensure_rust:     installs a Rust toolchain with rustup when `cargo` is missing, and the
#                  rustfmt and clippy components when they are (scripts/test's lint steps).
# ensure_cargo_fuzz: installs cargo-fuzz when missing (scripts/fuzz runs the fuzz targets).

# Host tools the test suite drives (NBD clients incl. nbdfuse, which Debian 12 ships in
# libnbd-bin; fio; md/thin tools; filesystems; `ip` from iproute2, which the docs tests'
# private network namespaces need), what the kernel lab's build.sh needs (qemu, cpio, kmod,
# zstd, xz), what building needs, and the OpenMetrics parser the metrics test checks scrapes
# with (python3-prometheus-client, 200 KB; Debian's `prometheus` package with promtool is 96 MB).
MDKIT_APT_PACKAGES=(
    build-essential pkg-config curl ca-certificates
    fio qemu-utils qemu-system-x86 libnbd-bin nbdkit nbd-client
    mdadm thin-provisioning-tools e2fsprogs fuse3 util-linux iproute2
    cpio kmod zstd xz-utils mold
    python3-prometheus-client
)

log() { printf '%s: %s\n' "${0##*/}" "$*" >&2; }

missing_packages() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || printf '%s\n' "$p"
    done
}

ensure_packages() {
    local wanted=("${MDKIT_APT_PACKAGES[@]}" "$@") missing pass
    mapfile -t missing < <(missing_packages "${wanted[@]}")
    ((${#missing[@]})) || return 0
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    # Two passes: installing one package can remove another that conflicts with it (Debian's
    # qemu-system-x86 removes a backported qemu-utils), which the second pass puts back at the
    # version that fits.
    for pass in 1 2; do
        log "installing apt packages: ${missing[*]}"
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
        mapfile -t missing < <(missing_packages "${wanted[@]}")
        ((${#missing[@]})) || return 0
    done
    log "still missing after installing: ${missing[*]}"
    return 1
}

ensure_rust() {
    [ -x "$HOME/.cargo/bin/cargo" ] && PATH="$HOME/.cargo/bin:$PATH"
    if ! command -v cargo >/dev/null; then
        log "installing the Rust toolchain with rustup"
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
            sh -s -- -y --profile minimal --default-toolchain stable --component rustfmt,clippy
        PATH="$HOME/.cargo/bin:$PATH"
    fi
    export PATH
    if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
        log "installing the rustfmt and clippy components"
        rustup component add rustfmt clippy
    fi
}

ensure_cargo_fuzz() {
    cargo fuzz --version >/dev/null 2>&1 && return 0
    log "installing cargo-fuzz"
    cargo install --locked cargo-fuzz
}

# Benchmarks: creates DIR and refuses a memory filesystem (tmpfs, ramfs: no device to measure).
bench_workdir() {
    local dir=$1 fstype
    mkdir -p "$dir"
    fstype=$(stat -f -c %T "$dir")
    case $fstype in tmpfs|ramfs) log "$dir is on $fstype; use a real filesystem (WORKDIR=...)"; exit 1 ;; esac
}

# NBD benchmarks: builds the release mdkit (sets MDKIT), creates the work dir DIR (a real
# filesystem) and the test file DIR/bench.img of SIZE (sets FILE), written once.
bench_mdkit_and_file() {
    local dir=$1 size=$2
    cargo build --release -p mdkit >&2
    MDKIT=$PWD/target/release/mdkit
    bench_workdir "$dir"
    FILE=$dir/bench.img
    written_file "$FILE" $(($(numfmt --from=iec "$size") >> 20))
}

# Benchmarks: an `mdkit serve` config at OUT with data_dir DATA_DIR, listening on 127.0.0.1:PORT
# (nbd.idle_poll_us IDLE_POLL_US), serving FILE (O_DIRECT required) as export "bench".
bench_file_config() {
    local out=$1 data_dir=$2 port=$3 idle_poll_us=$4 file=$5
    cat > "$out" <<TOML
data_dir = "$data_dir"
[nbd]
listen = ["127.0.0.1:$port"]
idle_poll_us = $idle_poll_us
[[volume]]
name = "bench"
kind = "file"
path = "$file"
direct = "require"
[[export]]
name = "bench"
volume = "bench"
TOML
}

# Benchmarks: waits (up to 10 s) until the NBD export at URI answers, then fails if it does not.
wait_export() {
    local uri=$1
    for _ in $(seq 100); do nbdinfo --size "$uri" >/dev/null 2>&1 && return 0; sleep 0.1; done
    nbdinfo --size "$uri" >/dev/null
}

# Benchmarks: background processes whose PIDs the script appends to `pids`, killed when it
# exits (`trap kill_pids EXIT`).
pids=()
kill_pids() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }

# Benchmarks: FILE of MIB MiB written once with zeroes (no holes, no unwritten extents, so the
# first measurement does not pay for allocation); kept when it already has that size.
written_file() {
    local f=$1 mib=$2
    if [ ! -f "$f" ] || [ "$(stat -c %s "$f")" != $((mib << 20)) ]; then
        log "writing member file $f ($mib MiB, once: no holes, no unwritten extents)"
        rm -f "$f"
        dd if=/dev/zero of="$f" bs=1M count="$mib" oflag=direct status=none
    fi
}
