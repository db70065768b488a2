use super::*;

#[test]
fn devinfo_gives_model_firmware_and_ports() {
    let text = "hca_id:\tmlx5_0\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t20.31.1014\n\tnode_guid:\t\t\t0c42:a103:00ab:cdef\n\tvendor_id:\t\t\t0x02c9\n\tvendor_part_id:\t\t\t4123\n\thw_ver:\t\t\t\t0x0\n\tboard_id:\t\t\tMT_0000000223\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tmax_mtu:\t\t4096 (5)\n\t\t\tactive_mtu:\t\t4096 (5)\n\t\t\tactive_width:\t\t4X (2)\n\t\t\tactive_speed:\t\t25.0 Gbps (32)\n\t\t\tlink_layer:\t\tInfiniBand\n\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0c42:a103:00ab:cdef\nhca_id:\trxe0\n\ttransport:\t\t\tInfiniBand (0)\n\t\tport:\t1\n\t\t\tlink_layer:\t\tEthernet\n";
    let d = parse_devinfo(text);
    assert_eq!(d.len(), 2);
    assert_eq!(d[0].name, "mlx5_0");
    assert_eq!(d[0].fw_ver, "20.31.1014");
    assert_eq!(d[0].vendor_part_id, "4123");
    assert_eq!(d[0].board_id, "MT_0000000223");
    assert_eq!(d[0].ports.len(), 1);
    assert_eq!(d[0].ports[0].active_mtu, "4096 (5)");
    assert_eq!(d[0].ports[0].active_speed, "25.0 Gbps (32)");
    assert_eq!(d[1].ports[0].link_layer, "Ethernet");
    assert!(!format!("{d:?}").contains("0c42"), "GUIDs stay out");
}

#[test]
fn target_side_is_the_difference_of_two_scrapes() {
    let page = |w: f64, inf: f64, sum: f64| {
        format!(
            "ramslog_lun_service_time_seconds_sum{{target=\"t\",lun=\"0\",kind=\"write\"}} {sum}\n\
             ramslog_lun_service_time_seconds_count{{target=\"t\",lun=\"0\",kind=\"write\"}} {inf}\n\
             ramslog_lun_service_time_seconds_bucket{{le=\"0.000008\",target=\"t\",lun=\"0\",kind=\"write\"}} {w}\n\
             ramslog_lun_service_time_seconds_bucket{{le=\"0.000016\",target=\"t\",lun=\"0\",kind=\"write\"}} {inf}\n\
             ramslog_lun_service_time_seconds_bucket{{le=\"+Inf\",target=\"t\",lun=\"0\",kind=\"write\"}} {inf}\n"
        )
    };
    let (before, after) = (page(10.0, 10.0, 0.00005), page(108.0, 110.0, 0.00065));
    let only = ("t".to_string(), "0".to_string());
    let t = target_side(&before, &after, 1.0, Some(&only)).expect("target side");
    let other = ("u".to_string(), "0".to_string());
    assert!(target_side(&before, &after, 1.0, Some(&other)).is_err());
    assert!(
        target_side(&after, &before, 1.0, None).is_err(),
        "a restart goes unnoticed"
    );
    assert_eq!(t.kinds.len(), 1);
    let k = &t.kinds[0];
    assert_eq!(k.commands, 100);
    assert!((k.mean_us - 6.0).abs() < 1e-6, "{}", k.mean_us);
    assert_eq!(k.p50_us_at_most, Some(8.0));
    assert_eq!(k.p99_us_at_most, Some(16.0));
}

#[test]
fn redaction_replaces_longest_names_first() {
    let r = Redactor {
        pairs: vec![
            ("10.0.0.10".into(), "box-2".into()),
            ("10.0.0.1".into(), "box-1".into()),
        ],
        scrub: false,
    };
    assert_eq!(
        r.apply("iser://10.0.0.10:3260 and 10.0.0.1:7470"),
        "iser://box-2:3260 and box-1:7470"
    );
}

#[test]
fn what_a_run_names_is_redacted_and_the_json_survives() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ReportArgs,
    }
    let cli = Cli::parse_from([
        "x",
        "iser://192.0.2.7:3260/iqn.2026-11.org.example:slog-a/0",
        "--compare",
        "iscsi://user%averylongsecret@flashbox.example:3260/iqn.2001-05.com.vendor:log/1",
        "--metrics",
        "192.0.2.8:9105",
        "--initiator-name",
        "iqn.1993-08.org.debian:01:myhost",
    ]);
    let r = Redactor::for_run(&cli.a);
    let text = r#"{"url":"iser://192.0.2.7:3260/iqn.2026-11.org.example:slog-a/0","b":"flashbox.example averylongsecret","c":"iqn.1993-08.org.debian:01:myhost 192.0.2.8 198.51.100.4:3260 naa.600144f0abcdef","rdma_bench":"0.1.0","fw":"20.31.1014","kernel":"6.1.0-57-amd64"}"#;
    let out = r.apply(text);
    for leak in [
        "192.0.2",
        "198.51",
        "slog-a",
        "flashbox",
        "averylongsecret",
        "myhost",
        "600144f0",
    ] {
        assert!(!out.contains(leak), "{leak} left in {out}");
    }
    let j: serde_json::Value = serde_json::from_str(&out).expect("still JSON");
    assert_eq!(j["rdma_bench"], "0.1.0");
    assert_eq!(j["fw"], "20.31.1014");
    assert_eq!(j["kernel"], "6.1.0-57-amd64");
    assert!(out.contains("iqn.redacted:target-1"), "{out}");
}
