//! The crates are layers (ARCHITECTURE.md): a crate depends only on crates below it. This
//! reads every crate's `Cargo.toml` and fails on a dependency that points up or sideways,
//! and on a crate missing from the list (a new crate must be given its layer).

use std::collections::BTreeMap;
use std::path::Path;

/// Each crate's layer, lowest first. A crate may depend on crates of lower layers only.
const LAYERS: &[(&str, u32)] = &[
    ("tessera-common", 0),
    ("tessera-tpch", 0),
    ("tessera-testkit", 0),
    ("tessera-storage", 1),
    ("tessera-net", 1),
    ("tessera-meta", 2),
    ("tessera-sql", 2),
    ("tessera-pg", 3),
    ("tessera-console", 3),
    ("tessera-flightsql", 3),
    ("tessera-replication", 3),
    ("tessera-exec", 4),
    ("tessera-recovery", 5),
    ("tessera-server", 6),
    ("tessera", 7),
];

#[test]
fn every_dependency_points_down_the_layers() {
    let layers: BTreeMap<&str, u32> = LAYERS.iter().copied().collect();
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut seen = 0;
    for entry in std::fs::read_dir(&crates).unwrap() {
        let manifest = entry.unwrap().path().join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else {
            continue;
        };
        let parsed: toml::Table = toml::from_str(&text).unwrap();
        let name = parsed["package"]["name"].as_str().unwrap().to_string();
        let layer = *layers
            .get(name.as_str())
            .unwrap_or_else(|| panic!("crate {name} has no layer in LAYERS"));
        seen += 1;
        let Some(dependencies) = parsed.get("dependencies").and_then(|d| d.as_table()) else {
            continue;
        };
        for dependency in dependencies.keys().filter(|d| d.starts_with("tessera")) {
            let below = layers[dependency.as_str()];
            assert!(
                below < layer,
                "{name} (layer {layer}) depends on {dependency} (layer {below}), which is not below it"
            );
        }
    }
    assert_eq!(seen, LAYERS.len(), "every crate was checked");
}
