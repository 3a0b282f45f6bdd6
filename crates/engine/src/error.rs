//! Errors of the engine.

use samesum_gguf::GgufError;
use samesum_quant::QuantError;

/// Result with [`EngineError`].
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Everything that can go wrong loading or running a model.
#[allow(missing_docs)]
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error("unsupported architecture {found:?} (supported: {supported})")]
    UnsupportedArch { found: String, supported: String },
    #[error("bad hyperparameter: {0}")]
    BadHParam(String),
    #[error("the model's tensors do not match its architecture ({} problems):\n  {}", .0.len(), first_problems(.0))]
    Tensors(Vec<String>),
    #[error("context full: position {pos} is past the context size {ctx}")]
    ContextFull { pos: usize, ctx: usize },
    #[error("cannot allocate the {what} for a context of {ctx} tokens ({bytes} bytes)")]
    Alloc {
        what: &'static str,
        ctx: usize,
        bytes: u128,
    },
    #[error("token id {token} is outside the vocabulary ({vocab} tokens)")]
    BadToken { token: u32, vocab: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("scoring: {0}")]
    Score(String),
    /// A device backend's failure, naming the operation or kernel.
    #[error("{backend}: {op}: {msg}")]
    Device {
        backend: &'static str,
        op: String,
        msg: String,
    },
}

/// The first problems of a list, one a line, and how many more there are
/// (a corrupt file can have millions).
fn first_problems(p: &[String]) -> String {
    const SHOWN: usize = 20;
    let mut s = p[..p.len().min(SHOWN)].join("\n  ");
    if p.len() > SHOWN {
        s += &format!("\n  ... and {} more", p.len() - SHOWN);
    }
    s
}
