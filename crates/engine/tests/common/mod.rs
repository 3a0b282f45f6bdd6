//! Helpers shared by the engine's integration tests.

use samesum_engine::Model;
use samesum_gguf::GgmlType;
use samesum_synth::{SynthOptions, shapes, write_model};

/// A synthetic model of shape `shape` in `quant`, weights from `seed`,
/// written to a temporary directory (kept alive by the returned handle)
/// and loaded.
pub(crate) fn synth_model(shape: &str, quant: GgmlType, seed: u64) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_model(
        &SynthOptions::new(shapes::by_name(shape).unwrap(), quant, seed),
        &p,
        &mut |_, _| {},
    )
    .unwrap();
    let model = Model::load(&p).unwrap();
    (dir, model)
}
