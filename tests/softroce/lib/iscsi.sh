# Sourced by lab test scripts: open-iscsi helpers (iscsid started once, stopped
# by PID at exit).

# open-iscsi's initiator name on this machine; one is made (and written
# where iscsid reads it) if the image has none.
initiator_name() {
  local name
  name=$(sed -n 's/^InitiatorName=//p' /etc/iscsi/initiatorname.iscsi 2>/dev/null)
  if [ -z "$name" ]; then
    name=iqn.2026-11.org.ramslog.lab:host
    mkdir -p /etc/iscsi
    echo "InitiatorName=$name" >/etc/iscsi/initiatorname.iscsi
  fi
  echo "$name"
}

iscsid_start() {
  modprobe iscsi_tcp; modprobe ib_iser; modprobe sd_mod   # no udev: nothing autoloads
  # Its own session: on SIGTERM iscsid signals its whole process group.
  setsid iscsid -f >/tmp/iscsid.log 2>&1 &
  ISCSID_PID=$!
  sleep 1
}

# What the initiator side saw, for a failed step: iscsid's own log (reconnect
# attempts, login errors) and the kernel's session and SCSI messages.
iscsi_diagnostics() {
  echo "--- iscsid log (last 60 lines) ---"
  tail -n 60 /tmp/iscsid.log 2>/dev/null || true
  echo "--- kernel messages (last 60 lines) ---"
  dmesg | tail -n 60
  echo "--- sessions ---"
  iscsiadm -m session -P1 2>&1 | head -40 || true
}

iscsid_stop() {
  iscsiadm -m node --logoutall=all >/dev/null 2>&1 || true
  if [ -n "${ISCSID_PID:-}" ]; then stop_pid "$ISCSID_PID"; fi
}

# The /dev/sdX of the session logged in to TARGET, waiting for the SCSI scan.
iscsi_disk() {
  local target=$1 i d
  for i in $(seq 1 100); do
    d=$(iscsiadm -m session -P3 2>/dev/null | awk -v t="$target" '$1=="Target:"{cur=$2} cur==t && /Attached scsi disk/{print "/dev/"$4; exit}')
    [ -n "$d" ] && [ -b "$d" ] && { echo "$d"; return 0; }
    sleep 0.2
  done
  return 1
}
