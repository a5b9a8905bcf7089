#!/usr/bin/env bash
# A CUDA 12 toolkit for the wheel's CUDA 12 library (tools/build_wheel.sh --majors 12,13), without
# NVIDIA's installer, installing nothing: Debian's packaged CUDA 12.4 (the non-free nvidia-cuda-toolkit
# of Debian 13, "trixie"), downloaded with apt-get and unpacked with dpkg -x, not installed, then laid
# out as a toolkit (bin/nvcc and its profile, nvvm/, include/, lib64/) that $CUDA_HOME can name.
#
#   bash tools/cuda12_from_debian.sh DIR          # then: CUDA_HOME=DIR bash tools/build_wheel.sh --majors 12,13
#
# Why Debian's: NVIDIA's CUDA 12 pip packages hold ptxas but no nvcc (CUDA 13's hold both), so pip
# cannot give CUDA 12 a compiler. CUDA 12.4's nvcc targets up to sm_90: the CUDA 12 library holds
# SASS for sm_75 to sm_90 and PTX for sm_90, which the driver of a newer GPU compiles at load.
# Needs apt-get and dpkg (a Debian or Ubuntu machine) and the Debian mirror this machine's apt is
# configured with (read from /etc/apt; nothing else is asked). Downloads about 1 GB (the headers come
# with the static libraries), unpacks 2.7 GB into DIR.
set -euo pipefail

home="${1:?usage: tools/cuda12_from_debian.sh DIR}"
suite=trixie
packages=(nvidia-cuda-toolkit nvidia-cuda-dev libnvvm4 libcudart12 libcu++-dev libcub-dev libthrust-dev)

# The Debian mirror apt already uses (a deb822 URIs: line, or a one-line deb entry), not debian-security.
mirror=$(
  {
    cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' || true
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | sed -E 's/\[[^]]*\]//' | awk '/^deb / {print $2}' || true
  } | awk '/\/debian\/?$/' | head -n 1
)
[ -n "$mirror" ] || { echo "cuda12_from_debian.sh: no Debian mirror in /etc/apt" >&2; exit 1; }

mkdir -p "$home"
home=$(cd "$home" && pwd)
work="$home/.debian"
rm -rf "$work"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/root"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main contrib non-free" >"$work/sources.list"
apt=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$work/lists"
  -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
echo "cuda12_from_debian.sh: $suite's ${packages[*]} from $mirror"
apt-get -qq "${apt[@]}" update
(cd "$work/debs" && apt-get -qq "${apt[@]}" download "${packages[@]}")
for deb in "$work"/debs/*.deb; do
  dpkg -x "$deb" "$work/root"
done
rm -rf "$work/debs" "$work/lists" "$work/cache"

# Debian puts nvcc in /usr/lib/nvidia-cuda-toolkit/bin with a profile at /etc/nvcc.profile naming
# /usr paths; nvcc reads the nvcc.profile beside its own binary, so it is copied, not linked, next to
# a profile that names this tree.
root="$work/root"
rm -rf "$home/bin" "$home/nvvm" "$home/include" "$home/lib64"
mkdir -p "$home/bin" "$home/nvvm/bin" "$home/nvvm/libdevice" "$home/nvvm/lib64"
cp "$root/usr/lib/nvidia-cuda-toolkit/bin/nvcc" "$home/bin/"
for tool in ptxas fatbinary nvlink cudafe++ bin2c cuobjdump nvdisasm cu++filt; do
  ln -s "$root/usr/bin/$tool" "$home/bin/$tool"
done
ln -s "$root/usr/lib/nvidia-cuda-toolkit/bin/crt" "$home/bin/crt"
cp "$root/usr/lib/nvidia-cuda-toolkit/bin/cicc" "$home/nvvm/bin/"
ln -s "$root/usr/lib/nvidia-cuda-toolkit/libdevice/libdevice.10.bc" "$home/nvvm/libdevice/"
ln -s "$root"/usr/lib/x86_64-linux-gnu/libnvvm.so* "$home/nvvm/lib64/"
ln -s "$root/usr/include" "$home/include"
ln -s "$root/usr/lib/x86_64-linux-gnu" "$home/lib64"
cat >"$home/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF

# The proof that it compiles and links a kernel.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf '__global__ void twice(float* x) { x[threadIdx.x] *= 2; }\nint main() { return 0; }\n' >"$probe/probe.cu"
"$home/bin/nvcc" -arch=sm_90 -o "$probe/probe" "$probe/probe.cu"
echo "cuda12_from_debian.sh: $("$home/bin/nvcc" --version | tail -n 1) at $home (CUDA_HOME=$home)"
