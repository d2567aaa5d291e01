//! A component checked against its name is not hashed again by the next process of the
//! same boot, unless its file changed: a node restarted after a crash serves its first
//! queries without reading every component they touch twice.

use std::path::Path;
use std::sync::Arc;
use tessera_common::ComponentHash;
use tessera_storage::component::component_path;
use tessera_storage::{StorageError, Store, StoreConfig, TableChanges};

mod common;
use common::{def, kv_rows};

fn open(dir: &Path) -> Arc<Store> {
    let store = Store::open(
        dir,
        StoreConfig {
            partitions: 4,
            ..StoreConfig::default()
        },
    )
    .unwrap();
    store.ensure_table(def()).unwrap();
    store
}

/// A store with `kv` flushed to components; their hashes.
fn flushed(dir: &Path) -> Vec<ComponentHash> {
    let store = open(dir);
    store
        .publish(vec![TableChanges::upserts("kv", vec![kv_rows(0, 4000)])])
        .unwrap();
    store.flush().unwrap();
    let snapshot = store.snapshot("kv", None).unwrap();
    let hashes: Vec<ComponentHash> = snapshot
        .partitions
        .iter()
        .flat_map(|p| p.components.iter().map(|c| c.hash))
        .collect();
    assert!(hashes.len() >= 2, "rows in several components");
    hashes
}

#[test]
fn components_checked_before_a_restart_are_trusted_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let hashes = flushed(dir.path());
    let store = open(dir.path());
    for hash in &hashes {
        assert!(
            store.is_verified(hash),
            "{hash} checked by the last process"
        );
    }
}

#[test]
fn a_component_changed_while_the_node_was_down_is_hashed_again() {
    let dir = tempfile::tempdir().unwrap();
    let hashes = flushed(dir.path());
    let (damaged, intact) = (hashes[0], hashes[1]);
    let path = component_path(&dir.path().join("components"), &damaged);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();

    let store = open(dir.path());
    assert!(store.is_verified(&intact));
    assert!(
        !store.is_verified(&damaged),
        "its file changed since its check"
    );
    let error = store.verify_component(&damaged).unwrap_err();
    assert!(
        matches!(error, StorageError::CorruptComponent { hash, .. } if hash == damaged),
        "{error}"
    );
    assert!(!store.is_verified(&damaged));
}

/// A component a crash left unreferenced is deleted at start: a copy that needs it again
/// must fetch it, though an earlier process checked it.
#[test]
fn a_component_deleted_at_start_is_no_longer_held() {
    let dir = tempfile::tempdir().unwrap();
    let hashes = flushed(dir.path());
    // Drop every manifest's first component, as an edited or older checkpoint would.
    let checkpoint = dir.path().join("checkpoint.json");
    let mut saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&checkpoint).unwrap()).unwrap();
    let mut dropped = Vec::new();
    for manifest in saved["tables"][0]["manifests"].as_array_mut().unwrap() {
        if let Some(components) = manifest["components"].as_array_mut() {
            if !components.is_empty() {
                dropped.push(components.remove(0)["hash"].clone());
            }
        }
    }
    assert!(!dropped.is_empty());
    std::fs::write(&checkpoint, serde_json::to_vec(&saved).unwrap()).unwrap();

    let store = open(dir.path());
    let gone: Vec<ComponentHash> = hashes
        .iter()
        .copied()
        .filter(|h| !component_path(&dir.path().join("components"), h).exists())
        .collect();
    assert_eq!(
        gone.len(),
        dropped.len(),
        "the unreferenced files were deleted"
    );
    for hash in &gone {
        assert!(!store.is_verified(hash), "{hash}");
        assert!(!store.has_component(hash), "{hash}");
    }
}

/// A copied component is checked against its name once, on arrival: bytes that do not
/// hash to it are refused and nothing is written under its name.
#[test]
fn a_copied_component_that_does_not_match_its_name_is_refused() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    flushed(a.path());
    let (primary, replica) = (open(a.path()), open(b.path()));
    let partition = tessera_common::PartitionId(0);
    let (components, memtable) = primary.export_partition("kv", partition).unwrap();
    assert!(!components.is_empty());
    let mut fetched: std::collections::HashMap<ComponentHash, Vec<u8>> = components
        .iter()
        .map(|c| (c.hash, primary.component_bytes(&c.hash).unwrap()))
        .collect();
    let damaged = components[0].hash;
    let bytes = fetched.get_mut(&damaged).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;

    let refused = replica.install_partition_components(
        "kv",
        partition,
        components.clone(),
        fetched.clone(),
        memtable.clone(),
        None,
    );
    assert!(
        matches!(refused, Err(StorageError::CorruptComponent { hash, .. }) if hash == damaged),
        "{refused:?}"
    );
    assert!(!component_path(&b.path().join("components"), &damaged).exists());
    assert!(!replica.has_component(&damaged));

    fetched.insert(damaged, primary.component_bytes(&damaged).unwrap());
    replica
        .install_partition_components("kv", partition, components.clone(), fetched, memtable, None)
        .unwrap();
    for component in &components {
        assert!(replica.has_component(&component.hash));
    }
}

/// Writing a component whose name is taken by a damaged file (rot since an earlier process
/// wrote the same bytes) replaces it with the bytes in hand, rather than trusting it.
#[test]
fn writing_a_component_over_a_damaged_file_of_its_name_repairs_it() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let primary = open(a.path());
    primary
        .publish(vec![TableChanges::upserts("kv", vec![kv_rows(0, 4000)])])
        .unwrap();
    let partition = tessera_common::PartitionId(1);
    let (components, memtable) = primary.export_partition("kv", partition).unwrap();
    assert!(
        components.is_empty() && !memtable.is_empty(),
        "rows in memory only"
    );
    let install = |replica: &Store| {
        replica
            .install_partition_components(
                "kv",
                partition,
                vec![],
                Default::default(),
                memtable.clone(),
                None,
            )
            .unwrap();
        // Read back from the directory: the copied versions are above this store's own
        // visible epoch, so its snapshots do not show them yet.
        let written: Vec<String> = std::fs::read_dir(b.path().join("components"))
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().into_string().ok())
            .filter_map(|name| name.strip_suffix(".parquet").map(str::to_string))
            .collect();
        assert_eq!(written.len(), 1, "the copied rows written as one component");
        ComponentHash::from_hex(&written[0]).unwrap()
    };
    let hash = install(&open(b.path()));
    let path = component_path(&b.path().join("components"), &hash);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x04;
    std::fs::write(&path, &bytes).unwrap();

    let replica = open(b.path());
    assert_eq!(install(&replica), hash, "the same rows, the same component");
    let now = std::fs::read(&path).unwrap();
    assert_eq!(
        ComponentHash::of_bytes(&now),
        hash,
        "the damaged file was replaced"
    );
    replica.verify_component(&hash).unwrap();
}
