use super::*;
use crate::component::{component_path, write_component};

/// A store directory with two component files in it.
fn two_components() -> (tempfile::TempDir, PathBuf, [ComponentHash; 2]) {
    let dir = tempfile::tempdir().unwrap();
    let components = dir.path().join("components");
    std::fs::create_dir_all(&components).unwrap();
    let a = write_component(&components, b"component a").unwrap();
    let b = write_component(&components, b"component b").unwrap();
    (dir, components, [a, b])
}

fn checked_now(components: &Path, hash: ComponentHash) -> Option<FileStamp> {
    FileStamp::of(&component_path(components, &hash))
}

fn boot(id: &str) -> Option<String> {
    Some(id.to_string())
}

/// A process of boot `boot-1`, started again.
fn reopen(dir: &Path, components: &Path) -> VerifiedComponents {
    VerifiedComponents::open(dir, components, boot("boot-1"))
}

/// A process of boot `boot-1` that has checked `hashes`.
fn checked(dir: &Path, components: &Path, hashes: &[ComponentHash]) -> VerifiedComponents {
    let verified = reopen(dir, components);
    for &hash in hashes {
        verified.insert(hash, checked_now(components, hash));
    }
    verified
}

/// A process of boot `boot-1` that checked `hashes` and ended.
fn checked_then_stopped(dir: &Path, components: &Path, hashes: &[ComponentHash]) {
    drop(checked(dir, components, hashes));
}

#[test]
fn checks_survive_a_restart_on_the_same_boot_only() {
    let (dir, components, [a, b]) = two_components();
    checked_then_stopped(dir.path(), &components, &[a, b]);

    let again = reopen(dir.path(), &components);
    assert!(
        again.contains(&a) && again.contains(&b),
        "same boot: trusted"
    );
    drop(again);

    let rebooted = VerifiedComponents::open(dir.path(), &components, boot("boot-2"));
    assert!(
        !rebooted.contains(&a) && !rebooted.contains(&b),
        "a new boot trusts nothing"
    );
    drop(rebooted);
    let back = reopen(dir.path(), &components);
    assert!(
        !back.contains(&a),
        "the new boot's journal replaced the old one's"
    );
}

#[test]
fn a_file_changed_since_its_check_is_not_trusted() {
    let (dir, components, [a, b]) = two_components();
    checked_then_stopped(dir.path(), &components, &[a, b]);
    // Same length, other bytes: only the file's change time tells.
    std::fs::write(component_path(&components, &a), b"component A").unwrap();
    std::fs::remove_file(component_path(&components, &b)).unwrap();
    let again = reopen(dir.path(), &components);
    assert!(!again.contains(&a), "rewritten since its check");
    assert!(!again.contains(&b), "gone");
}

#[test]
fn distrust_survives_a_restart() {
    let (dir, components, [a, b]) = two_components();
    let first = checked(dir.path(), &components, &[a, b]);
    // The scrubber found `a` damaged (bit rot leaves the file's identity as it was).
    first.remove(&a);
    // `b` checked again, its identity not known this time: the older line must not count.
    first.insert(b, None);
    assert!(first.contains(&b));
    drop(first);
    let again = reopen(dir.path(), &components);
    assert!(!again.contains(&a), "found damaged before the restart");
    assert!(
        !again.contains(&b),
        "its last check vouched for no file identity"
    );
}

#[test]
fn a_damaged_journal_costs_only_the_damaged_lines() {
    let (dir, components, [a, b]) = two_components();
    checked_then_stopped(dir.path(), &components, &[a]);
    let journal = dir.path().join(JOURNAL_FILE);
    let mut text = std::fs::read_to_string(&journal).unwrap();
    // A torn last line and some garbage, then a good line again.
    text.push_str("garbage line\n+ 00ff 1 2\n- not-a-hash\n");
    text.push_str(&checked_now(&components, b).unwrap().to_line(&b));
    text.push_str(&format!("+ {} 1 2 3", a.to_hex()));
    std::fs::write(&journal, text).unwrap();
    let again = reopen(dir.path(), &components);
    assert!(again.contains(&a) && again.contains(&b));

    std::fs::write(&journal, [0xff, 0xfe, 0x00, 0x01]).unwrap();
    let unreadable = reopen(dir.path(), &components);
    assert!(!unreadable.contains(&a), "not a journal: nothing trusted");
    unreadable.insert(a, checked_now(&components, a));
    drop(unreadable);
    let rewritten = reopen(dir.path(), &components);
    assert!(rewritten.contains(&a), "the journal was started afresh");
}

#[test]
fn the_journal_is_rewritten_once_deleted_components_crowd_it() {
    let (dir, components, [a, _]) = two_components();
    let verified = reopen(dir.path(), &components);
    let stamp = checked_now(&components, a);
    for _ in 0..3000 {
        verified.insert(a, stamp);
        verified.remove(&a);
    }
    verified.insert(a, stamp);
    let lines = std::fs::read_to_string(dir.path().join(JOURNAL_FILE))
        .unwrap()
        .lines()
        .count();
    assert!(lines < 1100, "{lines} lines for one trusted component");
    drop(verified);
    let again = reopen(dir.path(), &components);
    assert!(again.contains(&a));
}

#[test]
fn without_a_boot_id_nothing_is_journaled() {
    let (dir, components, [a, _]) = two_components();
    let verified = VerifiedComponents::open(dir.path(), &components, None);
    verified.insert(a, checked_now(&components, a));
    assert!(verified.contains(&a));
    assert!(!dir.path().join(JOURNAL_FILE).exists());
}

#[test]
fn this_machine_names_its_boot() {
    let id = current_boot_id().expect("Linux names its boot");
    assert_eq!(current_boot_id().as_deref(), Some(id.as_str()));
}
