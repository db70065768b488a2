//! Answers to the operational keys (RFC 7143 13, RFC 7145 6): the ranges,
//! defaults and result functions come from `ramslog_common::iscsi::keys`;
//! what this target wants, and the peer's limits, are decided here.

use super::*;

/// Negotiate one operational key; `None` means the key is declarative and needs no answer.
pub(super) fn negotiate(
    key: &str,
    value: &str,
    p: &mut Params,
    limits: &crate::iscsi::portal::Limits,
    kind: SessionKind,
) -> Option<String> {
    if matches!(value, "NotUnderstood" | "Irrelevant" | "Reject") {
        return None;
    }
    if kind == SessionKind::Discovery && keys::lookup(key).is_some_and(|k| k.normal_only) {
        return Some("Irrelevant".into());
    }
    let reject = || Some("Reject".to_string());
    // The illumos iSER initiator: no RDMAExtensions key, 16 KiB messages.
    let illumos_iser = p.iser_peer() == Some(IserPeer::Illumos);
    match key {
        "HeaderDigest" | "DataDigest" => {
            // iSER moves data by RDMA: digests do not apply (RFC 7145 6.3).
            let choice = value
                .split(',')
                .find(|v| *v == "None" || (*v == "CRC32C" && !p.iser));
            let Some(choice) = choice else {
                return reject();
            };
            let on = choice == "CRC32C";
            if key == "HeaderDigest" {
                p.header_digest = on;
            } else {
                p.data_digest = on;
            }
            Some(choice.into())
        }
        "MaxConnections" => keys::MAX_CONNECTIONS
            .number(value)
            .map_or_else(reject, |_| Some("1".into())),
        "InitialR2T" => parse_bool(value).map_or_else(reject, |v| {
            p.initial_r2t = v || limits.initial_r2t || illumos_iser;
            Some(yes_no(p.initial_r2t).into())
        }),
        "ImmediateData" => parse_bool(value).map_or_else(reject, |v| {
            p.immediate_data = v && limits.immediate_data && !illumos_iser;
            Some(yes_no(p.immediate_data).into())
        }),
        "MaxRecvDataSegmentLength" if p.rdma_extensions => Some("Irrelevant".into()),
        "MaxRecvDataSegmentLength" => match keys::MAX_RECV_DATA_SEGMENT_LENGTH.number(value) {
            Some(v) => {
                // illumos receives into fixed 16 KiB messages, headers included.
                let cap = if illumos_iser {
                    ramslog_common::iser::peer::ILLUMOS_MAX_RECV_DATA
                } else {
                    u32::MAX
                };
                p.initiator_mrdsl = (v as u32).min(cap);
                None
            }
            None => reject(),
        },
        "InitiatorRecvDataSegmentLength" if p.rdma_extensions => {
            match keys::INITIATOR_RECV_DATA_SEGMENT_LENGTH.number(value) {
                Some(v) => {
                    p.initiator_mrdsl = v as u32;
                    None
                }
                None => reject(),
            }
        }
        // A hint from the initiator; we declare our own value with the
        // operational stage's first response.
        "TargetRecvDataSegmentLength" if p.rdma_extensions => keys::TARGET_RECV_DATA_SEGMENT_LENGTH
            .number(value)
            .map_or_else(reject, |_| None),
        "MaxOutstandingUnexpectedPDUs" if p.rdma_extensions => {
            // Minimum, 0 meaning no limit: we send no unexpected PDUs but pings.
            keys::MAX_OUTSTANDING_UNEXPECTED_PDUS
                .number(value)
                .filter(|v| *v != 1)
                .map_or_else(reject, |v| Some(v.to_string()))
        }
        "MaxBurstLength" => keys::MAX_BURST_LENGTH
            .number(value)
            .map_or_else(reject, |v| {
                p.max_burst_len = (v as u32).min(limits.max_burst_len);
                Some(p.max_burst_len.to_string())
            }),
        "FirstBurstLength" => keys::FIRST_BURST_LENGTH
            .number(value)
            .map_or_else(reject, |v| {
                p.first_burst_len = (v as u32).min(limits.first_burst_len);
                Some(p.first_burst_len.to_string())
            }),
        "DefaultTime2Wait" => keys::DEFAULT_TIME2WAIT
            .number(value)
            .map_or_else(reject, |v| {
                p.default_time2wait = v as u32;
                Some(v.to_string())
            }),
        "DefaultTime2Retain" => keys::DEFAULT_TIME2RETAIN
            .number(value)
            .map_or_else(reject, |_| {
                // Error recovery level 0 retains nothing after a connection ends.
                p.default_time2retain = 0;
                Some("0".into())
            }),
        "MaxOutstandingR2T" => keys::MAX_OUTSTANDING_R2T
            .number(value)
            .map_or_else(reject, |v| {
                p.max_outstanding_r2t = (v as u32).min(limits.max_outstanding_r2t);
                Some(p.max_outstanding_r2t.to_string())
            }),
        "DataPDUInOrder" | "DataSequenceInOrder" => {
            // OR with our Yes: data always arrives in order.
            parse_bool(value).map_or_else(reject, |_| Some("Yes".into()))
        }
        "ErrorRecoveryLevel" => keys::ERROR_RECOVERY_LEVEL
            .number(value)
            .map_or_else(reject, |_| Some("0".into())),
        "IFMarker" | "OFMarker" => parse_bool(value).map_or_else(reject, |_| Some("No".into())),
        "IFMarkInt" | "OFMarkInt" => Some("Irrelevant".into()),
        "RDMAExtensions" => {
            parse_bool(value).map_or_else(reject, |v| Some(yes_no(v && p.iser).into()))
        }
        "TaskReporting" => Some("RFC3720".into()),
        "iSCSIProtocolLevel" => keys::ISCSI_PROTOCOL_LEVEL
            .number(value)
            .map_or_else(reject, |v| Some(v.min(1).to_string())),
        "TargetAlias" | "TargetAddress" | "TargetPortalGroupTag" | "SendTargets" => {
            Some("Irrelevant".into())
        }
        _ => Some("NotUnderstood".into()),
    }
}
