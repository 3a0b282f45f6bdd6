//! Models: hyperparameters, weight binding and the loaded model.

pub mod hparams;
pub mod rope;
pub mod weights;

pub use hparams::{Arch, HParams, LayerKind, Ssm};
pub use rope::{Rope, RopeScaling};
pub use weights::{Matrix, Weights};

use crate::error::Result;
use samesum_gguf::GgufFile;
use std::path::Path;

/// A loaded model: the mapped file, its hyperparameters and bound weights.
pub struct Model {
    /// The mapped GGUF file (weights are views into it).
    pub file: GgufFile,
    /// Hyperparameters.
    pub hp: HParams,
    /// Bound weights.
    pub w: Weights,
}

impl Model {
    /// Map `path`, read its hyperparameters and bind its tensors.
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        Model::from_file(GgufFile::open(path)?)
    }

    /// Bind an already opened file.
    pub fn from_file(file: GgufFile) -> Result<Model> {
        let hp = HParams::from_metadata(file.metadata(), file.tensors().len())?;
        let w = Weights::bind(&file, &hp)?;
        Ok(Model { file, hp, w })
    }

    /// The file's bytes (weights are offsets into them).
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        self.file.bytes()
    }
}
