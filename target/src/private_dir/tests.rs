use std::os::unix::fs::PermissionsExt;

use super::*;

fn fresh(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramslog-private-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn a_new_directory_is_0700_and_loose_read_bits_are_tightened() {
    let dir = fresh("new").join("a").join("b");
    prepare(&dir, "state directory").unwrap();
    assert_eq!(mode(&dir), 0o700);
    std::fs::write(dir.join("f"), "x").unwrap();
    chmod(&dir.join("f"), 0o644);
    chmod(&dir, 0o755);
    prepare(&dir, "state directory").unwrap();
    assert_eq!((mode(&dir), mode(&dir.join("f"))), (0o700, 0o600));
    let _ = std::fs::remove_dir_all(fresh("new"));
}

#[test]
fn what_others_could_have_changed_is_refused() {
    let dir = fresh("refuse");
    prepare(&dir, "image directory").unwrap();
    chmod(&dir, 0o730);
    let e = prepare(&dir, "image directory").unwrap_err();
    assert!(matches!(e, PrivateDirError::Writable { .. }), "{e}");
    assert!(e.to_string().contains("chmod go-w"), "{e}");
    assert_eq!(mode(&dir), 0o730, "a refusal changes nothing");
    chmod(&dir, 0o700);

    let f = dir.join("x.img");
    std::fs::write(&f, "x").unwrap();
    chmod(&f, 0o602);
    assert!(matches!(
        prepare(&dir, "image directory"),
        Err(PrivateDirError::Writable { .. })
    ));
    chmod(&f, 0o600);

    std::fs::remove_file(&f).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", &f).unwrap();
    let e = prepare(&dir, "image directory").unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    std::fs::remove_file(&f).unwrap();

    let made = std::process::Command::new("mkfifo")
        .arg(&f)
        .status()
        .unwrap();
    assert!(made.success());
    let e = prepare(&dir, "image directory").unwrap_err();
    assert!(e.to_string().contains("FIFO"), "{e}");
    std::fs::remove_file(&f).unwrap();

    let not_dir = dir.join("plain");
    std::fs::write(&not_dir, "x").unwrap();
    chmod(&not_dir, 0o600);
    assert!(matches!(
        prepare(&not_dir, "state directory"),
        Err(PrivateDirError::Create { .. } | PrivateDirError::NotADirectory { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Root can give a file away; as any other user there is nobody to give it
/// to, and CI runs as root.
#[test]
fn a_file_of_another_user_is_refused() {
    let dir = fresh("owner");
    prepare(&dir, "state directory").unwrap();
    let f = dir.join("luns.toml");
    std::fs::write(&f, "x").unwrap();
    chmod(&f, 0o600);
    if std::os::unix::fs::chown(&f, Some(65534), Some(65534)).is_err() {
        assert!(std::env::var_os("CI").is_none(), "CI runs as root");
        return;
    }
    let e = prepare(&dir, "state directory").unwrap_err();
    assert!(
        matches!(e, PrivateDirError::Owner { owner: 65534, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("chown"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn opens_never_follow_links_block_on_fifos_or_reuse_files() {
    let dir = fresh("open");
    prepare(&dir, "image directory").unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let e = open_regular(&link, 0).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    let e = create_private(&link, 0).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
    assert!(
        create_private(&victim, 0).is_err(),
        "never an existing file"
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");

    // A FIFO nobody writes to: refused at once instead of hanging the open.
    let fifo = dir.join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let e = open_regular(&fifo, 0).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");

    let fresh_file = dir.join("new");
    drop(create_private(&fresh_file, 0).unwrap());
    assert_eq!(mode(&fresh_file), 0o600);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory above the state (or image) directory that another user can
/// write lets that user rename the checked directory away and put one of
/// their own in its place after the check: refused, naming that directory.
/// A world-writable one with the sticky bit (/tmp) cannot be used so: its
/// entries can only be renamed by their owners.
#[test]
fn an_ancestor_others_can_write_is_refused_unless_sticky() {
    let top = fresh("ancestor");
    let open = top.join("open");
    std::fs::create_dir_all(&open).unwrap();
    chmod(&top, 0o755);
    chmod(&open, 0o777);
    let dir = open.join("state");
    let e = prepare(&dir, "state directory").expect_err("an ancestor others can write");
    assert!(
        e.to_string().contains(&open.display().to_string()) && e.to_string().contains("rename"),
        "{e}"
    );
    chmod(&open, 0o1777);
    prepare(&dir, "state directory").expect("a sticky ancestor");
    chmod(&open, 0o775);
    prepare(&dir, "state directory").expect_err("an ancestor its group can write");
    chmod(&open, 0o755);
    prepare(&dir, "state directory").expect("an ancestor only its owner can write");
    // A link in the middle of the path, in a directory others can write:
    // they could repoint it, whatever it points at now.
    let real = top.join("real");
    std::fs::create_dir_all(&real).unwrap();
    chmod(&real, 0o755);
    std::os::unix::fs::symlink(&real, open.join("link")).unwrap();
    chmod(&open, 0o777);
    let e = prepare(&open.join("link").join("state"), "state directory")
        .expect_err("a link in a directory others can write");
    assert!(e.to_string().contains(&open.display().to_string()), "{e}");
    chmod(&open, 0o755);
    prepare(&open.join("link").join("state"), "state directory")
        .expect("a link only root can repoint");
    let _ = std::fs::remove_dir_all(&top);
}
