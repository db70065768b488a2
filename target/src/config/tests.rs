use super::*;

/// An empty scratch directory of this test process.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ramslog-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A CHAP secret file holding `text`, readable by its owner only.
fn secret_file(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    path
}

#[test]
fn sizes() {
    assert_eq!(parse_size("4G"), Ok(4 << 30));
    assert_eq!(parse_size("256MiB"), Ok(256 << 20));
    assert_eq!(parse_size("4096"), Ok(4096));
    assert!(parse_size("4X").is_err());
    assert!(parse_size("99999999999T").is_err());
}

#[test]
fn non_loopback_needs_acl() {
    let args = RunArgs {
        size: Some(1 << 20),
        listen: vec!["0.0.0.0:3260".parse().unwrap()],
        ephemeral: true,
        ..Default::default()
    };
    let e = Config::load(&args).unwrap_err().to_string();
    assert!(e.contains("--allow"), "{e}");
    let ok = Config::load(&RunArgs {
        allow_any: true,
        ..args.clone()
    })
    .unwrap();
    assert!(ok.targets[0].open_access);
    let acl = Config::load(&RunArgs {
        allow: vec!["iqn.x".into(), "iqn.y@192.0.2.7/24".into()],
        ..args.clone()
    })
    .unwrap();
    assert!(!acl.targets[0].open_access);
    assert_eq!(acl.targets[0].allow[1].to_string(), "iqn.y@192.0.2.0/24");
    let e = Config::load(&RunArgs {
        allow: vec!["iqn.y@192.0.2.300/24".into()],
        ..args
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("IQN@192.0.2.0/24"), "{e}");
}

/// The access rule is judged after the flags: `--allow-any` or a loopback
/// `--listen` opens a file's ACL-less target, as without a file.
#[test]
fn flags_count_for_the_access_rule_of_a_file_target() {
    let dir = scratch("exposure");
    let file = dir.join("open.toml");
    std::fs::write(
        &file,
        "listen = [\"0.0.0.0:3260\"]\n[[target]]\nname = \"iqn.2026-11.org.ramslog:a\"\n[[target.lun]]\nsize = \"16M\"\n",
    )
    .unwrap();
    let args = RunArgs {
        config: Some(file.clone()),
        ephemeral: true,
        ..Default::default()
    };
    let refused = Config::load(&args)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(refused.contains("--allow-any"), "{refused}");
    let any = Config::load(&RunArgs {
        allow_any: true,
        ..args.clone()
    });
    assert!(any.is_ok(), "--allow-any: {:?}", any.err());
    let lo = Config::load(&RunArgs {
        listen: vec!["127.0.0.1:3260".parse().unwrap()],
        ..args
    });
    assert!(lo.is_ok(), "--listen 127.0.0.1: {:?}", lo.err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// RFC 7143 9.2.1: CHAP secrets are at least 96 bits; a shorter one is
/// refused at start, naming the file.
#[test]
fn short_chap_secrets_are_refused() {
    let dir = scratch("chap");
    let short = secret_file(&dir, "short.secret", "elevenbytes\n");
    let args = RunArgs {
        size: Some(1 << 20),
        ephemeral: true,
        chap_user: Some("u".into()),
        chap_secret_file: Some(short.clone()),
        ..Default::default()
    };
    let e = match Config::load(&args) {
        Ok(_) => "accepted".to_string(),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("96 bits"), "defect 11: an 11-byte secret: {e}");
    std::fs::write(&short, "twelve-bytes\n").unwrap();
    assert!(Config::load(&args).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

/// An ACL admits initiators by the name they claim: on a portal others can
/// reach, without CHAP any host may claim an allowed name. Said at every
/// start; loopback portals and targets with CHAP are quiet.
#[test]
fn an_exposed_acl_without_chap_is_warned_about() {
    let dir = scratch("acl-warn");
    let secret = secret_file(&dir, "chap.secret", "a-long-enough-secret\n");
    let args = RunArgs {
        size: Some(1 << 20),
        listen: vec!["192.0.2.1:3260".parse().unwrap()],
        allow: vec!["iqn.2026-01.org.example:host".into()],
        ephemeral: true,
        ..Default::default()
    };
    let warned = |args: &RunArgs| Config::load(args).unwrap().warnings().join("; ");
    let bare = warned(&args);
    let with_chap = warned(&RunArgs {
        chap_user: Some("u".into()),
        chap_secret_file: Some(secret.clone()),
        ..args.clone()
    });
    let loopback = warned(&RunArgs {
        listen: vec!["127.0.0.1:3260".parse().unwrap()],
        ..args.clone()
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        bare.contains("CHAP") && bare.contains("claim"),
        "an ACL without CHAP on 192.0.2.1: {bare:?}"
    );
    assert_eq!(with_chap, "", "CHAP set");
    assert_eq!(loopback, "", "loopback only");
}

/// A CHAP secret others can read is no secret: refused at start, naming
/// the file and the chmod.
#[test]
fn chap_secret_files_readable_by_others_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("chap-mode");
    let secret = dir.join("chap.secret");
    std::fs::write(&secret, "a-long-enough-secret\n").unwrap();
    let args = RunArgs {
        size: Some(1 << 20),
        ephemeral: true,
        chap_user: Some("u".into()),
        chap_secret_file: Some(secret.clone()),
        ..Default::default()
    };
    for mode in [0o640, 0o604, 0o644] {
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = match Config::load(&args) {
            Ok(_) => "accepted".to_string(),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("chmod 600") && e.contains(&secret.display().to_string()),
            "a secret readable by others (mode {mode:o}): {e}"
        );
    }
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o400)).unwrap();
    assert!(Config::load(&args).is_ok(), "0400 is fine");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 25 renamed the RDMA caps for a second RDMA front end; the names
/// users wrote before (`--max-iser-connections`, `max_iser_connections`,
/// and the pending ones) keep working, and giving both is refused.
#[test]
fn the_rdma_caps_answer_to_their_iser_names_too() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }
    let parse = |flags: &[&str]| {
        <Cli as clap::Parser>::try_parse_from(
            std::iter::once("ramslog-target").chain(flags.iter().copied()),
        )
        .map(|c| c.run)
    };
    let sized = |flags: &[&str]| parse(&[&["--size", "16M"], flags].concat());
    let old = sized(&[
        "--max-iser-connections",
        "7",
        "--max-pending-iser-logins",
        "3",
    ])
    .expect("old flags");
    let new = sized(&[
        "--max-rdma-connections",
        "7",
        "--max-pending-rdma-logins",
        "3",
    ])
    .expect("new flags");
    for args in [old, new] {
        let c = Config::load(&RunArgs {
            ephemeral: true,
            ..args
        })
        .expect("config");
        assert_eq!(
            (
                c.core_limits.connections.rdma,
                c.core_limits.connections.pending_rdma
            ),
            (7, 3)
        );
    }
    let both = parse(&["--max-iser-connections", "7", "--max-rdma-connections", "8"]);
    assert!(both.is_err(), "one cap, given twice");

    let dir = scratch("aliases");
    let load = |text: &str| {
        let file = dir.join("caps.toml");
        std::fs::write(&file, text).unwrap();
        Config::load(&RunArgs {
            config: Some(file),
            ephemeral: true,
            size: Some(16 << 20),
            ..Default::default()
        })
    };
    for text in [
        "max_iser_connections = 5\nmax_pending_iser_logins = 2\nmax_iscsi_connections = 9\n",
        "max_rdma_connections = 5\nmax_pending_rdma_logins = 2\nmax_iscsi_connections = 9\n",
    ] {
        let c = load(text).expect(text);
        let caps = c.core_limits.connections;
        assert_eq!(
            (caps.rdma, caps.pending_rdma, caps.iscsi),
            (5, 2, 9),
            "{text}"
        );
    }
    let twice = load("max_iser_connections = 5\nmax_rdma_connections = 6\n")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(twice.contains("max_rdma_connections"), "{twice}");
    let zero = load("max_iscsi_connections = 0\n")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        zero.contains("max_iscsi_connections must be at least 1"),
        "{zero}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kept_memory_is_on_unless_the_flag_or_the_file_turns_it_off() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }
    let dir = scratch("kept-memory");
    let file = dir.join("kept.toml");
    let load = |flags: &[&str], text: Option<&str>| {
        let mut run = <Cli as clap::Parser>::try_parse_from(
            ["ramslog-target", "--size", "16M", "--ephemeral"]
                .into_iter()
                .chain(flags.iter().copied()),
        )
        .map_err(|e| e.to_string())?
        .run;
        if let Some(text) = text {
            std::fs::write(&file, text).unwrap();
            run.config = Some(file.clone());
        }
        Config::load(&run)
            .map(|c| c.kept_memory)
            .map_err(|e| e.to_string())
    };
    assert_eq!(load(&[], None), Ok(true));
    assert_eq!(load(&["--kept-memory", "off"], None), Ok(false));
    assert_eq!(load(&["--kept-memory", "on"], None), Ok(true));
    assert_eq!(load(&[], Some("kept_memory = false\n")), Ok(false));
    assert_eq!(
        load(&["--kept-memory", "on"], Some("kept_memory = false\n")),
        Ok(true),
        "the flag wins"
    );
    let bad = load(&["--kept-memory", "no"], None).unwrap_err();
    assert!(bad.contains("use on or off"), "{bad}");
    let bad = load(&[], Some("kept_memory = \"off\"\n")).unwrap_err();
    assert!(
        bad.contains("kept.toml:1:") && bad.contains("expected a boolean"),
        "{bad}"
    );
}

#[test]
fn the_restart_drain_is_100_ms_unless_set_within_its_bounds() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }
    let dir = scratch("restart-drain");
    let file = dir.join("drain.toml");
    let load = |flags: &[&str], text: Option<&str>| {
        let mut run = <Cli as clap::Parser>::try_parse_from(
            ["ramslog-target", "--size", "16M", "--ephemeral"]
                .into_iter()
                .chain(flags.iter().copied()),
        )
        .map_err(|e| e.to_string())?
        .run;
        if let Some(text) = text {
            std::fs::write(&file, text).unwrap();
            run.config = Some(file.clone());
        }
        Config::load(&run)
            .map(|c| c.core_limits.restart_drain)
            .map_err(|e| e.to_string())
    };
    let ms = Duration::from_millis;
    assert_eq!(load(&[], None), Ok(ms(100)));
    assert_eq!(load(&["--restart-drain-ms", "1000"], None), Ok(ms(1000)));
    assert_eq!(load(&[], Some("restart_drain_ms = 250\n")), Ok(ms(250)));
    for bad in ["0", "10001"] {
        let e = load(&["--restart-drain-ms", bad], None).unwrap_err();
        assert!(
            e.contains("restart_drain_ms must be between 1 and 10000 milliseconds"),
            "{e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
