# Sourced by lab test scripts: LIO (the kernel target) as the peer to compare with.

# LIO through configfs (targetcli-fb wants a system D-Bus the guest lacks;
# configfs is what it writes anyway): a 256 MiB rd_mcp ramdisk on ADDR:PORT
# (3260 unless given), iSER-enabled unless TRANSPORT is tcp. SERIAL sets the
# unit serial (LIO derives the NAA WWN from it): two LUNs in one boot need
# distinct ones, and the same serial recreates a LUN under the same identity.
#
#   lio_export IQN ADDR NAME [TRANSPORT [PORT [SERIAL]]]
lio_export() {
  local iqn=$1 addr=$2 name=$3 transport=${4:-iser} port=${5:-3260} serial=${6:-}
  local c=/sys/kernel/config/target tpg=/sys/kernel/config/target/iscsi/$1/tpgt_1
  modprobe target_core_mod && modprobe iscsi_target_mod && modprobe ib_isert
  mkdir -p "$c/core/rd_mcp_0/$name"
  echo rd_pages=65536 >"$c/core/rd_mcp_0/$name/control"
  if [ -n "$serial" ]; then echo "$serial" >"$c/core/rd_mcp_0/$name/wwn/vpd_unit_serial"; fi
  echo 1 >"$c/core/rd_mcp_0/$name/enable"
  mkdir -p "$tpg/lun/lun_0"
  ln -s "$c/core/rd_mcp_0/$name" "$tpg/lun/lun_0/$name"
  mkdir "$tpg/np/$addr:$port"
  if [ "$transport" = iser ]; then echo 1 >"$tpg/np/$addr:$port/iser"; fi
  local kv
  for kv in authentication=0 generate_node_acls=1 demo_mode_write_protect=0 cache_dynamic_acls=1; do
    echo "${kv#*=}" >"$tpg/attrib/${kv%=*}"
  done
  echo 1 >"$tpg/enable"
}

lio_remove() {
  local iqn=$1 addr=$2 name=$3 port=${4:-3260}
  local c=/sys/kernel/config/target tpg=/sys/kernel/config/target/iscsi/$1/tpgt_1
  echo 0 >"$tpg/enable"
  rm "$tpg/lun/lun_0/$name"
  rmdir "$tpg/lun/lun_0" "$tpg/np/$addr:$port" "$tpg" "$c/iscsi/$iqn" "$c/core/rd_mcp_0/$name"
}
