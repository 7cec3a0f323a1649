#!/usr/bin/env bash
# Install halo-agent as a systemd service on a Raspberry Pi (aarch64 Debian / Raspberry Pi OS bookworm).
#   sudo ./install-agent.sh WHEEL_OR_PINNED_REQUIREMENT [CLUSTER_KEY_FILE] [MODEL_FILE]
# e.g. sudo ./install-agent.sh ./halo_edge-0.1.0-cp311-cp311-linux_aarch64.whl ./cluster.key ./stories260K.bin
#      sudo HALO_WHEEL_SHA256=<sha256 of the wheel> ./install-agent.sh ./halo_edge-....whl   (checked before install)
#      sudo ./install-agent.sh halo-edge==0.1.0                                              (an exact version only)
# (a wheel built on aarch64 carries the compact-group C kernel; from source, gcc below builds it)
set -euo pipefail
package="${1:-}"
key="${2:-}"
model="${3:-}"
here="$(cd "$(dirname "$0")" && pwd)"

# what gets installed as root is named exactly: a wheel file (its sha256 checked when HALO_WHEEL_SHA256 is set, and
# printed always) or one pinned version, never whatever an index serves under a bare name
if [ -z "$package" ]; then
  echo "give the wheel to install (or halo-edge==VERSION): sudo $0 ./halo_edge-VERSION-....whl [KEY] [MODEL]" >&2
  exit 2
elif [ -f "$package" ]; then
  digest="$(sha256sum "$package" | cut -d' ' -f1)"
  echo "installing $package (sha256 $digest)"
  if [ -n "${HALO_WHEEL_SHA256:-}" ] && [ "$digest" != "$HALO_WHEEL_SHA256" ]; then
    echo "$package has sha256 $digest, not HALO_WHEEL_SHA256=$HALO_WHEEL_SHA256: refusing to install it" >&2
    exit 2
  fi
elif ! [[ "$package" =~ ^halo-edge==[0-9]+(\.[0-9]+)*$ ]]; then
  echo "$package is neither a wheel file nor an exact version (halo-edge==X.Y.Z): refusing to install it" >&2
  exit 2
fi

[ "$(id -u)" = 0 ] || { echo "run as root (sudo)"; exit 1; }
arch="$(uname -m)"
[ "$arch" = aarch64 ] || echo "note: this script targets aarch64 boards; continuing on $arch"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "halo needs Python >= 3.11"; exit 1; }
apt-get install -y -q python3-venv gcc python3-dev >/dev/null  # gcc + headers: halo's C kernel when built here

id halo >/dev/null 2>&1 || useradd --system --home /opt/halo --shell /usr/sbin/nologin halo
install -d -o root -g root -m 0755 /opt/halo /opt/halo/models
install -d -o root -g halo -m 0750 /etc/halo
python3 -m venv /opt/halo/venv
/opt/halo/venv/bin/pip install -q --upgrade pip
/opt/halo/venv/bin/pip install -q "$package"      # core only: numpy, pyzmq, onnxruntime, onnx, psutil
# this very wheel's code, even where the same version is installed already (a rebuilt wheel keeps its version number:
# pip would call it satisfied and leave the old code in place)
/opt/halo/venv/bin/pip install -q --force-reinstall --no-deps "$package"
/opt/halo/venv/bin/python -c 'from halo.compute.linear import COMPACT_KERNEL; print("compact groups computed by", COMPACT_KERNEL)'

if [ -n "$model" ]; then
  install -o root -g root -m 0644 "$model" /opt/halo/models/
  # HALO mode's MLP groups laid out for re-mapping (read-only for the service; see `halo-agent prepare --help`)
  HALO_PREPARED_DIR=/opt/halo/prepared /opt/halo/venv/bin/halo-agent prepare \
      --model "/opt/halo/models/$(basename "$model")" \
    || echo "note: no prepared groups (a float model needs none for --weights native; see halo-agent prepare --help)"
fi
if [ -f /etc/halo/agent.toml ]; then
  # the old example's `weights = "fp32"` did nothing; weights now restricts the agent to that format: out with it
  sed -i 's/^weights = "fp32" *# or "int8": ~3.5x less memory.*$/# & (commented out by the installer: weights now means "serve only this format")/' /etc/halo/agent.toml
  echo "kept /etc/halo/agent.toml ($(grep -E '^(model|name|weights) ' /etc/halo/agent.toml | tr -s ' ' | cut -d'#' -f1 | paste -sd';'))"
else  # the example, named after this host and pointing at the model installed above (or the bundled one)
  install -o root -g halo -m 0640 "$here/agent.example.toml" /etc/halo/agent.toml
  escape() { printf '%s' "$1" | sed -e 's/[\\"]/\\&/g' -e 's/[&|\\]/\\&/g'; }  # a TOML string, in sed's replacement
  sed -i "s|^name = \"[^\"]*\"|name = \"$(escape "$(hostname)")\"|" /etc/halo/agent.toml
  if [ -n "$model" ]; then
    sed -i "s|^model = \"[^\"]*\"|model = \"/opt/halo/models/$(escape "$(basename "$model")")\"|" /etc/halo/agent.toml
  else
    sed -i 's|^model = |# model = |' /etc/halo/agent.toml  # the agent's default: the bundled stories260K
  fi
fi
if [ -n "$key" ]; then
  install -o halo -g halo -m 0600 "$key" /etc/halo/cluster.key
elif [ ! -f /etc/halo/cluster.key ]; then
  echo "no cluster key yet: copy the one from \`halo-master keygen\` to /etc/halo/cluster.key (owner halo, mode 0600)"
fi
install -d -o root -g root -m 0755 /etc/systemd/system
install -o root -g root -m 0644 "$here/halo-agent.service" /etc/systemd/system/halo-agent.service
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl enable --now halo-agent
  systemctl --no-pager status halo-agent | head -5
  echo "logs: journalctl -u halo-agent -f"
else  # a chroot or container (the arm64 install test): the unit is in place for the next boot
  echo "systemd is not running here: halo-agent.service is installed, not started; by hand:"
  echo "  runuser -u halo -- /opt/halo/venv/bin/halo-agent --config /etc/halo/agent.toml"
fi
