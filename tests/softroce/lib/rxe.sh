# Sourced by lab test scripts: bring SoftRoCE up on a veth pair and export its
# addresses; tear it down on exit. All addresses are private to the guest (or
# to this host's veth pair): nothing leaves the machine.
#
#   rxe_up      creates veth pair rsl-a/rsl-b with RXE_ADDR_A/RXE_ADDR_B, rxe
#               devices RXE_DEV_A on rsl-a and RXE_DEV_B on rsl-b
#   rxe_down    removes them (also run by the EXIT trap rxe_up installs)
#
# In rdma_rxe of Linux 6.1 a client and a server on the same rxe device and IP
# work ("rxe loopback"), and so does each device talking to its own IP; across
# two devices in one namespace the local route wins and CM fails; rxe has no
# network-namespace support. Tests therefore run client and server on one
# device's address, or each "box" on its own device's address.

RXE_ADDR_A=${RXE_ADDR_A:-10.99.0.1}
RXE_ADDR_B=${RXE_ADDR_B:-10.99.0.2}
RXE_DEV_A=rsl-rxe-a
RXE_DEV_B=rsl-rxe-b
export RXE_ADDR_A RXE_ADDR_B RXE_DEV_A RXE_DEV_B

rxe_up() {
  modprobe rdma_rxe && modprobe rdma_ucm && modprobe ib_uverbs || { echo "rxe: modules missing" >&2; return 1; }
  ip link add rsl-a type veth peer name rsl-b || return 1
  ip addr add "$RXE_ADDR_A/24" dev rsl-a && ip addr add "$RXE_ADDR_B/24" dev rsl-b || return 1
  ip link set rsl-a up && ip link set rsl-b up || return 1
  rdma link add "$RXE_DEV_A" type rxe netdev rsl-a || return 1
  rdma link add "$RXE_DEV_B" type rxe netdev rsl-b || return 1
  trap rxe_down EXIT
  local i
  for i in $(seq 1 50); do
    ibv_devices 2>/dev/null | grep -q "$RXE_DEV_B" && return 0
    sleep 0.2
  done
  echo "rxe: devices did not appear" >&2
  return 1
}

rxe_down() {
  # Teardown runs from EXIT traps under `set -e`: nothing here may fail.
  # rxe cannot take a device away from a process that holds it open:
  # `rdma link delete` would wait in D state for ever (seen: a script that
  # failed before stopping its daemons hung until the suite's timeout).
  # Whatever still holds an RDMA device now is a leftover: named, killed.
  local fd pid holders=()
  for fd in /proc/[0-9]*/fd/*; do
    [[ $(readlink "$fd" 2>/dev/null) == /dev/infiniband/* ]] || continue
    pid=${fd#/proc/}
    pid=${pid%%/*}
    [[ $pid == "$$" || " ${holders[*]} " == *" $pid "* ]] && continue
    holders+=("$pid")
    echo "rxe_down: process $pid ($(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120)) still holds an RDMA device: killed"
    kill -9 "$pid" 2>/dev/null || true
  done
  ((${#holders[@]} == 0)) || sleep 0.5
  rdma link delete "$RXE_DEV_A" 2>/dev/null || true
  rdma link delete "$RXE_DEV_B" 2>/dev/null || true
  ip link delete rsl-a 2>/dev/null || true
}
